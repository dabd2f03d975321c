"""Helpers the tests share (imported as ``support.<module>``; ``tests/`` is on ``sys.path``).

- `models`: small models and their samples; `language_models`: tiny transformers models and a decode loop.
- `backends`: backends that exist only for tests (they show which path a call took).
- `emulated_graph`: a CPU stand-in for device graphs.
- `clock`: a fake clock whose time only metered calls spend (timings a test chooses).
- `compare_calls`: a tuned call against eager's, result or error.
- `package_tools`: damage, rewrite or inspect a package.
- `hub_server`: a Hub-compatible server (olah) on loopback.
- `split_models`: a model whose layers sit on several devices.
- `torchrun`: runs a script as several ranks and collects what each wrote.
- `concurrent_loader`, `kill_points`, `rank_loader`, `tp_worker`: programs that tests run in fresh processes
  (the last two as torchrun ranks).
"""
