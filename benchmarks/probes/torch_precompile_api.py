"""What the installed torch offers for ahead-of-time precompiled functions (printed as JSON).

python benchmarks/probes/torch_precompile_api.py
"""

import inspect
import json

import torch

report = {"torch": torch.__version__}
compiled = torch.compile(lambda x: x)
report["compiled_function_has_aot_compile"] = hasattr(compiled, "aot_compile")
report["load_compiled_function"] = (
    str(inspect.signature(torch.compiler.load_compiled_function))
    if hasattr(torch.compiler, "load_compiled_function")
    else None
)
try:
    from torch._dynamo import aot_compile

    report["aot_compile_fullgraph"] = str(inspect.signature(aot_compile.aot_compile_fullgraph))
    report["AOTCompiledFunction"] = [
        name for name in vars(aot_compile.AOTCompiledFunction) if not name.startswith("__")
    ]
except Exception as exc:  # noqa: BLE001 - a probe reports whatever is missing
    report["aot_compile_module"] = f"{type(exc).__name__}: {exc}"
report["aoti"] = [name for name in ("aoti_compile_and_package", "aoti_load_package") if hasattr(torch._inductor, name)]
print(json.dumps(report, indent=2))
