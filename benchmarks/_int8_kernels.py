"""Triton int8 weight-only GEMV/GEMM kernels for ``int8_linears.py``: an experiment, not part of xpupack.

Each takes int8 weights ``[N, K]`` with a scale per row and returns ``scale * (x @ w.T)`` in ``x``'s type.
The launchers take ``(rows per program, K per step, warps, stages)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_cvt(
    x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr
):
    """Batch 1: y[n] = scale[n] * sum_k x[k] * w[n, k], the int8 weights converted by ``.to(float32)``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:  # no mask along K: the loads stay 16 bytes wide
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
            x = tl.load(x_ptrs)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
            x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, (tl.sum(acc, axis=1) * scale).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int8_word_byte(words, shift: tl.constexpr):
    """Byte ``shift // 8`` of each int32 word as a float32, through integer operations only."""
    return ((((words >> shift) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _gemv_magic(
    x_ptr, w_ptr, s_ptr, y_ptr, N, KW, stride_wn, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr
):
    """Batch 1, the int8 weights read as int32 words [N, K / 4] and converted with integer operations."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kw = tl.arange(0, BLOCK_KW)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_kw[None, :]
    x_ptrs = x_ptr + offs_kw * 4
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    for k in range(0, tl.cdiv(KW, BLOCK_KW)):
        if EVEN_K:
            words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
            x0 = tl.load(x_ptrs).to(tl.float32)
            x1 = tl.load(x_ptrs + 1).to(tl.float32)
            x2 = tl.load(x_ptrs + 2).to(tl.float32)
            x3 = tl.load(x_ptrs + 3).to(tl.float32)
        else:
            k_mask = offs_kw < KW - k * BLOCK_KW
            words = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
            x0 = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptrs + 1, mask=k_mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptrs + 2, mask=k_mask, other=0.0).to(tl.float32)
            x3 = tl.load(x_ptrs + 3, mask=k_mask, other=0.0).to(tl.float32)
        acc += (
            _int8_word_byte(words, 0) * x0[None, :]
            + _int8_word_byte(words, 8) * x1[None, :]
            + _int8_word_byte(words, 16) * x2[None, :]
            + _int8_word_byte(words, 24) * x3[None, :]
        )
        w_ptrs += BLOCK_KW
        x_ptrs += BLOCK_KW * 4
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, (tl.sum(acc, axis=1) * scale).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_dot(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Small batches: the int8 weights converted to the activations' type, multiplied with ``tl.dot``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, (acc * scale[None, :]).to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _launch(kernel, rows, config, arguments, **blocks):
    """``kernel`` over ``rows`` output rows, ``config[0]`` per program, with ``config``'s warps and stages."""
    block_n, _, warps, stages = config
    kernel[(triton.cdiv(rows, block_n),)](*arguments, BLOCK_N=block_n, **blocks, num_warps=warps, num_stages=stages)


def launch_cvt(x, w, s, config):
    (_, k), n, block_k = x.shape, w.shape[0], config[1]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(_gemv_cvt, n, config, (x, w, s, y, n, k, w.stride(0)), BLOCK_K=block_k, EVEN_K=k % block_k == 0)
    return y


def launch_magic(x, w, s, config):
    words = w.view(torch.int32)
    n, kw, block_kw = w.shape[0], words.shape[1], config[1] // 4  # config[1]: bytes of a row per step
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(
        _gemv_magic, n, config, (x, words, s, y, n, kw, words.stride(0)), BLOCK_KW=block_kw, EVEN_K=kw % block_kw == 0
    )
    return y


def launch_dot(x, w, s, config):
    (m, k), n, block_k = x.shape, w.shape[0], config[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    arguments = (x, w, s, y, m, n, k, x.stride(0), w.stride(0), y.stride(0))
    _launch(
        _gemm_dot,
        n,
        config,
        arguments,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
    )
    return y
