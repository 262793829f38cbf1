"""Compile a Triton kernel ahead of time for sm_90 (the H200) with the installed Triton and
its ptxas, without a GPU: what the kernel tests use to check register use and the
instructions a tile choice compiles to."""
from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Compiled:
    ptx: str
    resources: str  # ptxas' resource line ("REG:... STACK:... SHARED:...")


def compile_for_h200(kernel, signature: dict[str, str], consts: dict, aligned: list[str],
                     **options) -> Compiled:
    """``signature``: argument name -> Triton type ("constexpr" for those in ``consts``);
    ``aligned``: arguments declared 16-divisible, as Triton specializes them at launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    source = ASTSource(kernel, signature,
                       {(names.index(c),): v for c, v in consts.items()},
                       {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    return Compiled(compiled.asm["ptx"], next(line for line in usage.splitlines()
                                              if "REG:" in line))
