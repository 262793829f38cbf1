"""`radixlm-serve`: run a real tritonserver on this repository's model repository.

The server comes from the ``nvidia-pytriton`` wheel installed in the running environment.
Before exec-ing it we assemble a backend directory under ``build/triton_backends``::

    build/triton_backends/
      python/   libtriton_python.so, triton_python_backend_utils.py,
                triton_python_backend_stub (the stub built for this Python version)
      radixlm/  model.py: one import of backend.model (models select it with
                backend: "radixlm"; the stub finds the installed package, see below)

and fix the environment the stub needs: it ignores PYTHONPATH and imports from the
site-packages of the first ``python3`` on PATH, so this environment's ``bin/`` goes first
(that is also where ``backend.core`` is installed); it needs the wheel's bundled
libraries (libcudart, ...) on LD_LIBRARY_PATH.

Every argument is passed to tritonserver unchanged; ``--model-repository`` and
``--backend-directory`` are added only when the caller does not give them, and so are the
defaults of ``backend.server_flags`` (a bounded exit, the administrative APIs behind the
admin token, the stubs' shared-memory regions named for this process).

tritonserver runs as a child of this process, which supervises it (``backend.supervisor``):
a stub that dies stops the server, every stop ends within a bound, and what a killed
server leaves behind is removed. Its exit status is tritonserver's (1 when a failure
stopped it).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

from backend.admin_access import ensure_token
from backend.server_flags import bounds_for, hardened_args, server_plan
from backend.supervisor import supervise

BACKEND_NAME = "radixlm"
REPO_ROOT = Path(__file__).resolve().parent.parent


class LaunchError(RuntimeError):
    """A piece the server needs is missing; the message says which and how to fix it."""


class ServerFiles(NamedTuple):
    tritonserver: Path
    python_backend: Path  # folder with libtriton_python.so + triton_python_backend_utils.py
    stub: Path
    libs: Path  # nvidia_pytriton.libs


def find_server_files(python_version: str | None = None) -> ServerFiles:
    """Locate the server pieces inside the installed nvidia-pytriton wheel."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(
            "nvidia-pytriton is not installed in this environment "
            f"({sys.prefix}); run `make` targets or `pip install -r requirements.txt`"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    server_dir = package_dir / "tritonserver"
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    files = ServerFiles(
        tritonserver=server_dir / "bin" / "tritonserver",
        python_backend=server_dir / "backends" / "python",
        stub=server_dir / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=package_dir.parent / "nvidia_pytriton.libs",
    )
    for path in (files.tritonserver, files.python_backend / "libtriton_python.so",
                 files.python_backend / "triton_python_backend_utils.py", files.libs):
        if not path.exists():
            raise LaunchError(f"missing {path} (is nvidia-pytriton==0.7.0 fully installed?)")
    if not files.stub.exists():
        have = sorted(p.name for p in files.stub.parent.parent.iterdir())
        raise LaunchError(
            f"the wheel has no Python backend stub for Python {version} "
            f"(it has {', '.join(have)}); use one of those Python versions"
        )
    return files


def _copy(source: Path, dest: Path) -> None:
    """Copy ``source`` to ``dest`` unless an identical copy (size and mtime) is there."""
    if dest.is_symlink():
        dest.unlink()
    if dest.exists():
        a, b = source.stat(), dest.stat()
        if a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime):
            return
    shutil.copy2(source, dest)


# Triton loads a Python-based backend from <backend dir>/<name>/model.py; the backend
# itself is the installed ``backend`` package, which the stub imports from the venv's
# site-packages (no symlink into the source tree, no sys.path edit).
SHIM = ('"""The radixlm Python-based backend for Triton (written by radixlm-serve): the '
        'model class\nis backend/model.py of the installed radixlm-server package."""\n'
        'from backend.model import TritonPythonModel  # noqa: F401\n')


def _write_shim(path: Path) -> None:
    if path.is_symlink() or path.is_dir():
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if not path.exists() or path.read_text() != SHIM:
        path.write_text(SHIM)


def assemble_backend_dir(files: ServerFiles, out_dir: Path, model_py: Path) -> Path:
    """Create (or refresh) the backend directory; returns it. Idempotent."""
    if not model_py.is_file():
        raise LaunchError(f"missing the backend's model.py at {model_py}")
    python_dir = out_dir / "python"
    ours_dir = out_dir / BACKEND_NAME
    python_dir.mkdir(parents=True, exist_ok=True)
    ours_dir.mkdir(parents=True, exist_ok=True)
    # Copies, not links: tritonserver refuses a backend library that resolves outside
    # the backend directory.
    _copy(files.python_backend / "libtriton_python.so", python_dir / "libtriton_python.so")
    _copy(files.python_backend / "triton_python_backend_utils.py",
          python_dir / "triton_python_backend_utils.py")
    _copy(files.stub, python_dir / "triton_python_backend_stub")
    # An import, so edits to backend/model.py take effect on the next model load.
    _write_shim(ours_dir / "model.py")
    return out_dir


def check_environment() -> None:
    """Fail early on the pitfalls that otherwise surface as a crashed stub."""
    try:
        numpy_version = importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError as exc:
        raise LaunchError("numpy is not installed in this environment") from exc
    if int(numpy_version.split(".")[0]) >= 2:
        raise LaunchError(
            f"numpy {numpy_version} is installed; the Python backend stub corrupts string "
            "tensors with numpy 2, install numpy<2 (requirements.txt pins 1.26.4)"
        )
    if importlib.util.find_spec("backend.core") is None:
        raise LaunchError("backend.core is not importable here; run `pip install -e .`")
    bin_dir = Path(sys.prefix) / "bin"
    if not (bin_dir / "python3").exists():
        raise LaunchError(f"{bin_dir}/python3 does not exist; run radixlm-serve from a venv")
    if python_libdir() is None:
        print(f"radixlm-serve: warning: {sys.executable} has no shared libpython; the Python "
              "backend stub will load the system's, whose version may not match this "
              "interpreter's standard library", file=sys.stderr)


def python_libdir() -> Path | None:
    """The folder holding this interpreter's shared libpython, if it has one.

    The stub links ``libpython3.X.so.1.0`` but imports the standard library of the venv's
    base interpreter; both must be the same build (a pyenv 3.11.7 ``_ssl`` module does not
    load into Debian's 3.11.2 libpython), so the stub must find this interpreter's first.
    """
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not soname or not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    return Path(libdir) if (Path(libdir) / soname).exists() else None


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def build_command(args: list[str], files: ServerFiles, backend_dir: Path,
                  model_repository: Path) -> list[str]:
    command = [str(files.tritonserver)]
    if not _has_flag(args, "--model-repository") and not _has_flag(args, "--model-store"):
        command.append(f"--model-repository={model_repository}")
    if not _has_flag(args, "--backend-directory"):
        command.append(f"--backend-directory={backend_dir}")
    return command + list(args)


def build_env(files: ServerFiles, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                if p and p != bin_dir])
    # Bundled libraries first; then this interpreter's libpython folder, unless it is a
    # system folder the loader searches anyway (listing it would shadow bundled ones).
    lib_dirs = [str(files.libs)]
    libdir = python_libdir()
    if libdir is not None and not str(libdir).startswith(("/usr/lib", "/lib")):
        lib_dirs.append(str(libdir))
    lib_dirs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def prepare(args: list[str], repo_root: Path = REPO_ROOT) -> tuple[list[str], dict[str, str]]:
    """Everything `main` does short of exec: returns (command, environment)."""
    check_environment()
    files = find_server_files()
    model_repository = repo_root / "model_repository"
    if not _has_flag(args, "--model-repository") and not model_repository.is_dir():
        raise LaunchError(f"missing the model repository {model_repository}")
    backend_dir = assemble_backend_dir(files, repo_root / "build" / "triton_backends",
                                       repo_root / "backend" / "model.py")
    return build_command(args, files, backend_dir, model_repository), build_env(files)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nusage: radixlm-serve [tritonserver flags...]")
        return 0
    try:
        command, env = prepare(args)
        token = ensure_token(env)
        command = [command[0]] + hardened_args(command[1:], token, os.getpid())
        bounds = bounds_for(command[1:], env)
    except (LaunchError, ValueError) as exc:
        print(f"radixlm-serve: error: {exc}", file=sys.stderr)
        return 2
    shown = " ".join(command).replace(token, "<admin token>")
    print(f"radixlm-serve: {shown}", file=sys.stderr, flush=True)
    return supervise(server_plan(command, env, os.getpid()), bounds)


if __name__ == "__main__":
    sys.exit(main())
