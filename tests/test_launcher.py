"""radixlm-serve: backend directory assembly, flag pass-through, environment."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from backend import launcher

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files() -> launcher.ServerFiles:
    return launcher.find_server_files()


def test_finds_the_wheel_pieces_for_this_python(files):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert files.tritonserver.name == "tritonserver" and files.tritonserver.is_file()
    assert files.stub.parent.name == version and files.stub.is_file()
    assert (files.python_backend / "libtriton_python.so").is_file()
    assert files.libs.name == "nvidia_pytriton.libs" and files.libs.is_dir()


def test_missing_stub_version_is_a_clear_error():
    with pytest.raises(launcher.LaunchError, match=r"no Python backend stub for Python 2\.7.*3\.11"):
        launcher.find_server_files(python_version="2.7")


def test_assembles_backend_dir_with_copies_and_a_model_that_imports_the_backend(files, tmp_path):
    out = launcher.assemble_backend_dir(files, tmp_path / "backends", REPO / "backend" / "model.py")
    python_dir = out / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py",
                 "triton_python_backend_stub"):
        assert (python_dir / name).is_file() and not (python_dir / name).is_symlink()
    assert os.access(python_dir / "triton_python_backend_stub", os.X_OK)
    model_py = out / "radixlm" / "model.py"
    assert model_py.is_file() and not model_py.is_symlink()
    assert "from backend.model import TritonPythonModel" in model_py.read_text()
    # idempotent: a second run keeps the same files
    inode = (python_dir / "libtriton_python.so").stat().st_ino
    launcher.assemble_backend_dir(files, tmp_path / "backends", REPO / "backend" / "model.py")
    assert (python_dir / "libtriton_python.so").stat().st_ino == inode


def test_missing_model_py_is_a_clear_error(files, tmp_path):
    with pytest.raises(launcher.LaunchError, match="model.py"):
        launcher.assemble_backend_dir(files, tmp_path / "b", tmp_path / "nope" / "model.py")


def test_adds_repository_and_backend_dir_and_passes_flags_through(files):
    command = launcher.build_command(["--http-port", "18000", "--log-verbose=1"], files,
                                     Path("/b"), Path("/repo/model_repository"))
    assert command == [str(files.tritonserver), "--model-repository=/repo/model_repository",
                       "--backend-directory=/b", "--http-port", "18000", "--log-verbose=1"]


def test_user_model_repository_wins(files):
    for args in (["--model-repository=/mine"], ["--model-repository", "/mine"]):
        command = launcher.build_command(args, files, Path("/b"), Path("/default"))
        assert not any(a.startswith("--model-repository=/default") for a in command)
        assert command[-len(args):] == args


def test_environment_puts_venv_bin_first_and_bundled_libs_on_the_loader_path(files):
    env = launcher.build_env(files, {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.prefix) / "bin"), "/usr/bin", "/bin"]
    libdirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libdirs[0] == str(files.libs) and libdirs[-1] == "/opt/lib"
    libpython = launcher.python_libdir()
    if libpython is not None and not str(libpython).startswith(("/usr/lib", "/lib")):
        # the stub must load this interpreter's libpython, not the system's
        assert libdirs[1] == str(libpython)


def test_prepare_targets_this_repository():
    command, env = launcher.prepare(["--grpc-port", "18001"])
    assert f"--model-repository={REPO / 'model_repository'}" in command
    assert f"--backend-directory={REPO / 'build' / 'triton_backends'}" in command
    assert (REPO / "build" / "triton_backends" / "radixlm" / "model.py").exists()
    assert command[-2:] == ["--grpc-port", "18001"]


def test_main_reports_missing_pieces_without_a_traceback(monkeypatch, capsys):
    def missing(*_a, **_k):
        raise launcher.LaunchError("missing something specific")

    monkeypatch.setattr(launcher, "find_server_files", missing)
    assert launcher.main(["--http-port", "1"]) == 2
    assert "radixlm-serve: error: missing something specific" in capsys.readouterr().err
