"""Backends: how one module is built at tune time, saved into a package, and restored at load time.

This package imports nothing: ``import xpupack.backends`` costs no torch. The
modules are `base` (the contract below, `ModuleSpec` and `Samples`, the registry), `eager`,
`graph`, `inductor`, `torchao` with `torchao_configs`, `_facts` (what
`xpupack.plan` asks of a backend, answered without torch for inspect/verify) and
`_megacache` (what Inductor's carried mega-cache holds, counted without torch or pickle).

The contract (`base.Backend`; a new backend subclasses it and is made
resolvable from a manifest with `base.register_backend`):

``name``
    The name a manifest stores (``"graph"``); ``label`` names a composition
    (``"graph+torchao"``).
``available(device)`` / ``why_unavailable(device)``
    Whether it can run on ``device`` at all, and why not (no device graphs on a CPU).
``build(target, spec, device) -> Runner``
    At tune time, with recorded samples in ``spec.samples`` (a `xpupack.module_spec.Samples`):
    builds what runs the module's calls (records graphs, compiles, quantizes). A
    strategy compares the runner's outputs with eager's (``compare``) before it
    keeps it. A `xpupack.module_spec.ModuleSpec` is frozen: what its ``spec.json`` holds, built
    complete before any backend sees it; a backend only reads it.
``save(runner, folder) -> dict``
    Writes the runner's artifacts into ``folder`` (``modules/<path>/<name>/``) and
    returns its JSON config, which the manifest stores.
``restore(target, spec, config, folder, device, *, use_artifacts) -> Runner``
    At load time, from ``spec``'s signatures only (``spec.samples`` is None) and what
    `save` wrote. ``use_artifacts=False``: compiled artifacts must not run
    (untrusted source, environment mismatch), so rebuild from portable parts.
    Every file a config names is opened through `xpupack.manifest.artifact_file`.
``save_shared(folder, runners) -> dict | None`` / ``restore_shared(config, folder, *, use_artifacts)``
    Artifacts written once for all modules of a backend (Inductor's cache, under
    ``backends/<name>/``); the defaults share nothing.
``options() -> dict``
    Constructor options as JSON; ``backend_from_json(name, options)`` rebuilds the
    same backend and refuses options the backend would not write itself.
Class attributes
    ``depends_on`` (environment keys whose change invalidates the artifacts),
    ``compiled_artifacts`` (they may unpickle or run native code: the trust rule
    applies), ``rebuildable``, ``supports_autograd``, ``supports_autocast``,
    ``transforms_module``, ``pads_calls``: see `base.Backend`.

A `base.Runner` executes the calls: ``run(index, args, kwargs, leaves)`` runs
one call of signature ``index`` (one of ``runner.supported``); ``leaves`` are
the call's inputs flattened in the signature's leaf order (what a device graph
copies into its static buffers), ``args``/``kwargs`` the same call unflattened.
The dispatcher (`xpupack.tuned`) decides whether a call fits a signature; a
runner only ever sees calls that do. A runner that can pad a smaller batch
into its own buffers sets ``run_padded`` (the graph runner does); otherwise the
dispatcher pads a copy of the call and uses ``run``. ``undo``/``redo`` take back and reapply
what building or restoring changed in the module (TorchAO's quantized
weights), so a rejected candidate or a failed load leaves the module as it was.
``add_signature(index, signature, args, kwargs)`` hands the runner a new size of a
signature with state that the dispatcher met while serving (a KV cache of another
length), numbered after the spec's signatures; the spec does not change. A runner
that must compile for it returns a future of that work, done off the caller's path
(`xpupack._background`), and the dispatcher runs the original module until it
finishes; by default a runner hands it on to its ``base_runner``.

A load may restore compiled code off the caller's path (``xpupack.load(...,
defer_compile=True)``, docs/cold-start.md): inside such a load
`xpupack._background.deferred()` is true, and a backend may return a runner
that serves at once without its compiled code and queues the rest with
`xpupack._background.later` (the jobs start once every module is restored).
The graph backend over Inductor records the original module and takes the
compiled code when it is ready (`GraphRunner.upgrade_when_ready`), asking its
base to get ready for a call with state through ``prepare(index, args,
kwargs)`` (a future, or None when ready); the Inductor backend runs the
original module meanwhile and sets ``checked_where_compiled``, since the worker
checks its compiled code against the original before any call runs it. Over a
base that changes the module (TorchAO) the Inductor backend compiles at once,
but its calls with state only off the caller's path: its runner sets
``prepares_state_calls``, and a graph runner over it records the quantized
module for those calls until its base is ready for them
(`GraphRunner.prepare_state_calls`).
"""
