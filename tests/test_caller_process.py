"""A load never disturbs the process it runs in (reliability round 4, group 1): with the default load nothing of
it runs on after `xpupack.load` returns, so the caller's own compiles, settings, random streams and forks are
theirs alone. Each check runs in a fresh process, as a server starts."""

import json

import pytest

pytestmark = pytest.mark.slow  # fresh processes that compile

_AFTER_LOAD = """
import json, os, random, sys, threading, torch, xpupack
from support.models import make_stack
random.seed(7)
expected_draw = random.Random(7).random()
model = xpupack.load(make_stack(seed=4), {root!r})
found = {{"threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()]}}
x = torch.randn(4, 8)
# a fork right after the load (gunicorn --preload): the child serves and compiles
reader, writer = os.pipe()
child = os.fork()
if child == 0:
    with torch.no_grad():
        ok = bool(torch.allclose(model(x), make_stack()(x), atol=1e-5))
    value = float(torch.compile(lambda t: (t + 1).sum())(torch.ones(2)))
    os.write(writer, json.dumps({{"served": ok, "compile": value}}).encode())
    os._exit(0)
os.close(writer)
_, status = os.waitpid(child, 0)
found["child"] = json.loads(os.read(reader, 4096) or b"null")
found["child_status"] = status
# the caller's settings, made after the load, stay
torch.set_default_dtype(torch.float64)
torch.use_deterministic_algorithms(True)
found["random_not_rewound"] = random.random() == expected_draw
# the caller's own torch.compile works
found["compile"] = float(torch.compile(lambda t: (t * 2).sum())(torch.ones(3)))
torch.use_deterministic_algorithms(False)
found["dtype_kept"] = str(torch.get_default_dtype())
torch.set_default_dtype(torch.float32)
with torch.no_grad():
    found["served"] = bool(torch.allclose(model(x), make_stack()(x), atol=1e-5))
print(json.dumps(found))
"""


def test_after_a_load_no_thread_runs_and_the_callers_compile_settings_random_and_fork_are_its_own(
    inductor_package, run_python
):
    _, root = inductor_package
    found = json.loads(run_python(_AFTER_LOAD.format(root=str(root))).stdout.strip().splitlines()[-1])
    assert found["threads"] == []
    assert found["random_not_rewound"] and found["compile"] == 6.0 and found["dtype_kept"] == "torch.float64"
    assert found["served"]
    assert found["child_status"] == 0 and found["child"] == {"served": True, "compile": 4.0}
