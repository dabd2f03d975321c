"""Canaries for the private PyTorch entry points `xpupack._torch_compat` names: each fails loudly on a torch
release that changes one, before a user meets the change."""

import pytest
import torch
from torch import nn

from xpupack import _torch_compat


def test_the_storage_check_in_c_compares_addresses():
    tensors = [torch.zeros(2), torch.ones(3)]
    addresses = [t.data_ptr() for t in tensors]
    if _torch_compat.data_ptrs_equal is None:
        pytest.skip(f"torch {torch.__version__} lacks it; the Python loop does the check")
    assert _torch_compat.data_ptrs_equal(tensors, addresses, [0, 1])
    tensors[1].data = torch.ones(3)
    assert not _torch_compat.data_ptrs_equal(tensors, addresses, [0, 1])


@pytest.mark.slow  # a C++ compile
def test_a_package_compiled_without_its_weights_runs_on_the_tensors_it_is_handed(tmp_path):
    module = nn.Linear(4, 3)
    with torch.no_grad():
        exported = torch.export.export(module, (torch.randn(2, 4),), strict=False)
        path = _torch_compat.aoti_compile(exported, tmp_path / "linear.pt2")
    loader = _torch_compat.aoti_load(path)
    names = _torch_compat.aoti_constant_names(loader)
    assert sorted(names) == ["bias", "weight"]
    _torch_compat.aoti_use_constants(loader, {"weight": module.weight.detach(), "bias": module.bias.detach()})
    x = torch.randn(2, 4)
    (out,) = _torch_compat.aoti_run(loader, [x])
    assert torch.allclose(out, module(x).detach(), atol=1e-6)
    with torch.no_grad():  # user-managed: the package reads the tensors themselves, not a copy
        module.weight.zero_()
    (out,) = _torch_compat.aoti_run(loader, [x])
    assert torch.allclose(out, module.bias.detach().expand(2, 3), atol=1e-6)
    with pytest.raises(RuntimeError):  # every constant must be handed in
        _torch_compat.aoti_use_constants(_torch_compat.aoti_load(path), {"weight": module.weight.detach()})
