"""Decisions behind warm workers' fidelity to torchrun (``elastic.warm``), tested without processes."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from elastic import warm
from elastic.workers import PdeathsigEntrypoint, ScriptEntrypoint, fall_back_to_plain_workers, warm_entrypoint


def test_import_time_env_changes_name_only_variables_the_preloaded_modules_read() -> None:
    started = {"OMP_NUM_THREADS": "1", "HOME": "/root", "PATH": "/bin"}
    after_imports = {**started, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}
    unchanged = {**started, "HOME": "/elsewhere", "RANK": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert warm.import_time_env_changes(started, after_imports, unchanged) == []
    # The value an import set itself is the value a worker importing torch would compute: no difference.
    assert warm.import_time_env_changes(started, after_imports, after_imports) == []
    changed = {**started, "OMP_NUM_THREADS": "8", "MKL_DEBUG_CPU_TYPE": "5", "TORCHINDUCTOR_CACHE_DIR": "/x"}
    assert warm.import_time_env_changes(started, after_imports, changed) == [
        "MKL_DEBUG_CPU_TYPE", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"]
    removed = {"HOME": "/root", "PATH": "/bin"}
    assert warm.import_time_env_changes(started, after_imports, removed) == ["OMP_NUM_THREADS"]


def test_fallback_reason_names_the_variables_and_the_missing_forkserver() -> None:
    env = {"OMP_NUM_THREADS": "1"}
    flags = SimpleNamespace(isolated=0, ignore_environment=0, no_site=0, no_user_site=0, safe_path=False)
    assert warm.warm_fallback_reason((env, env), env, flags) is None
    assert "not started" in (warm.warm_fallback_reason(None, env, flags) or "")
    reason = warm.warm_fallback_reason((env, env), {"OMP_NUM_THREADS": "4"}, flags)
    assert reason is not None and "OMP_NUM_THREADS" in reason
    isolated = SimpleNamespace(isolated=1, ignore_environment=1, no_site=0, no_user_site=1, safe_path=True)
    assert "-I" in (warm.warm_fallback_reason((env, env), env, isolated) or "")


def test_worker_environ_is_the_agents_plus_torchs_per_worker_variables() -> None:
    agent = {"PATH": "/bin", "LATE": "set after the forkserver started"}
    forkserver = {"PATH": "/bin", "TORCHINDUCTOR_CACHE_DIR": "/tmp/i", "RANK": "0"}
    inherited = {**forkserver, "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}
    assert warm.worker_environ(agent, forkserver, inherited) == {
        "PATH": "/bin", "LATE": "set after the forkserver started", "RANK": "0", "LOCAL_RANK": "0",
        "MASTER_PORT": "29500"}


def test_fresh_sys_path_replaces_the_agents_own_first_entry(tmp_path) -> None:
    rest = ["/lib/python3.11", "/site-packages"]
    console = str(tmp_path / "bin" / "spotrun")
    assert warm.fresh_sys_path([str(tmp_path / "bin"), *rest], console, "/cwd", "/job", False) == ["/job", *rest]
    assert warm.fresh_sys_path(["/cwd", *rest], "-m", "/cwd", "/job", False) == ["/job", *rest]
    assert warm.fresh_sys_path(["/pythonpath", *rest], console, "/cwd", "/job", False) == ["/job", "/pythonpath", *rest]
    assert warm.fresh_sys_path(rest, console, "/cwd", "/job", True) == rest


@pytest.mark.parametrize(("exc", "expected"), [
    (None, (0, None)), (SystemExit(), (0, None)), (SystemExit(0), (0, None)), (SystemExit(3), (3, None)),
    (SystemExit(256 + 7), (7, None)), (SystemExit(True), (1, None)), (SystemExit("bye"), (1, "bye\n")),
    (ValueError("x"), (1, None)),
])
def test_exit_status_is_cpythons(exc: BaseException | None, expected: tuple[int, str | None]) -> None:
    assert warm.exit_status(exc) == expected


def test_fall_back_rewrites_the_spec_to_torchruns_command_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    entry, args = warm_entrypoint(sys.executable, ["-u", "train.py", "--lr", "1"])  # type: ignore[misc]  # python -u script: never None
    spec = SimpleNamespace(entrypoint=PdeathsigEntrypoint(entry, agent_pid=4242), args=tuple(args))
    monkeypatch.setattr(warm, "_forkserver_environ", None)
    warm.note_forkserver_environ(dict(os.environ), dict(os.environ))
    assert fall_back_to_plain_workers(spec) is None
    assert isinstance(spec.entrypoint, PdeathsigEntrypoint)

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    reason = fall_back_to_plain_workers(spec)
    assert reason is not None and "OMP_NUM_THREADS" in reason
    assert spec.entrypoint == sys.executable
    assert spec.args[:2] == ("-S", sys.modules["elastic.workers"].__file__.rstrip("c"))
    assert spec.args[2:] == ("4242", sys.executable, "-u", "train.py", "--lr", "1")
    assert fall_back_to_plain_workers(spec) is None  # already plain: nothing more to say


def test_cold_command_of_a_module_entrypoint() -> None:
    entry = ScriptEntrypoint("pkg.train", module=True, python="/py", options=("-u",))
    assert entry.cold_command(("x",)) == ("/py", ("-u", "-m", "pkg.train", "x"))


def test_shadowed_preloads_names_a_script_directory_module(tmp_path) -> None:
    loaded = tmp_path / "site" / "elastic" / "__init__.py"
    loaded.parent.mkdir(parents=True)
    loaded.write_text("")
    origins = {"elastic": str(loaded), "fsspec": "/site/fsspec/__init__.py", "torch": None}
    script_dir = tmp_path / "job"
    script_dir.mkdir()
    assert warm.shadowed_preloads(["elastic", "fsspec"], [str(script_dir)], origins.get) == []
    (script_dir / "elastic.py").write_text("")  # the user's own module, next to the script
    (script_dir / "fsspec").mkdir()  # a data directory, not a package: not imported by `import fsspec`
    assert warm.shadowed_preloads(["elastic", "fsspec"], [str(script_dir)], origins.get) == [
        f"elastic ({script_dir / 'elastic.py'})"]
    # The preloaded package itself on the path (a repo root on PYTHONPATH) is not a shadow.
    assert warm.shadowed_preloads(["elastic"], [str(loaded.parent.parent)], origins.get) == []
    (script_dir / "torch.cpython-311-x86_64-linux-gnu.so").write_text("")
    assert [s.split(" ")[0] for s in warm.shadowed_preloads(["torch"], [str(script_dir)], origins.get)] == ["torch"]


def test_a_script_with_its_own_elastic_module_falls_back_to_plain_workers(tmp_path, monkeypatch) -> None:
    (tmp_path / "elastic.py").write_text("NAME = 'mine'\n")
    script = tmp_path / "train.py"
    script.write_text("import elastic\n")
    spec = SimpleNamespace(entrypoint=ScriptEntrypoint(str(script)), args=())
    monkeypatch.setattr(warm, "_forkserver_environ", None)
    warm.note_forkserver_environ(dict(os.environ), dict(os.environ))
    reason = fall_back_to_plain_workers(spec)
    assert reason is not None and f"elastic ({tmp_path / 'elastic.py'})" in reason
    assert spec.entrypoint == sys.executable and spec.args[-1] == str(script)


def test_a_worker_started_during_the_agents_background_import_does_not_get_its_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher imports torch._dynamo in a thread, which sets TORCHINDUCTOR_CACHE_DIR until the thread
    removes it again; a worker started in between must see the agent's environment as torchrun's would be."""
    from elastic import warm

    monkeypatch.setattr(warm, "_agent_import_baseline", None)
    before = {"HOME": "/h", "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}  # the user's own compiler variable stays
    warm.note_agent_import_start(before, ("TORCHINDUCTOR_", "TRITON_"))
    now = {**before, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root", "RANK_HINT": "x"}
    assert warm.agent_environ_now(now) == {**before, "RANK_HINT": "x"}


def _fake_torch(monkeypatch: pytest.MonkeyPatch, *, dynamo_imported: bool = True) -> SimpleNamespace:
    """A stand-in for the modules ``warm.defer_dynamo_import_effects`` reads, as the forkserver leaves them:
    ``torch._dynamo`` imported and bound on ``torch``, ``torch.distributed.nn.functional`` imported before any
    process group existed (its ``group`` defaults are None)."""
    from types import ModuleType

    torch = ModuleType("torch")

    def lazy(name: str) -> object:
        raise AttributeError(f"module 'torch' has no attribute {name!r}")

    torch.__getattr__ = lazy  # type: ignore[attr-defined]  # torch's own lazy-module hook
    dynamo = ModuleType("torch._dynamo")
    functional = ModuleType("torch.distributed.nn.functional")
    exec("def all_reduce(tensor, op=0, group=None):\n    return group\n"
         "def gather(tensor, dst=0, group=None):\n    return group\n"
         "def no_group(tensor, dst=None):\n    return dst\n", functional.__dict__)
    functional.__dict__["imported"] = lambda tensor, group=None: group  # another module's function: left alone
    functional.__dict__["imported"].__module__ = "elsewhere"
    c10d = ModuleType("torch.distributed.distributed_c10d")
    c10d.GroupMember = SimpleNamespace(WORLD=None)  # type: ignore[attr-defined]  # torch's class property
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed.nn.functional", functional)
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    if dynamo_imported:
        torch._dynamo = dynamo  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torch._dynamo", dynamo)
    else:
        monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    return SimpleNamespace(torch=torch, dynamo=dynamo, functional=functional, c10d=c10d, lazy=lazy)


def test_functional_group_defaults_take_the_default_group_at_the_first_dynamo_touch_after_init(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, DDP's constructor imports torch._dynamo (a lazy attribute of torch), which imports
    torch.distributed.nn.functional: its ``group=group.WORLD`` defaults then hold the default group."""
    fake = _fake_torch(monkeypatch)
    warm.defer_dynamo_import_effects()
    assert "_dynamo" not in vars(fake.torch)  # lazy again, as in a fresh interpreter
    # init_process_group touches torch._dynamo before it sets the group: nothing captured, still lazy.
    assert fake.torch._dynamo is fake.dynamo
    assert "_dynamo" not in vars(fake.torch)
    assert fake.functional.all_reduce(None) is None
    world = object()
    fake.c10d.GroupMember.WORLD = world
    assert fake.torch._dynamo is fake.dynamo  # DDP's constructor: the import torchrun's worker does here
    assert vars(fake.torch)["_dynamo"] is fake.dynamo
    assert vars(fake.torch)["__getattr__"] is fake.lazy  # torch's own hook back, for good
    assert fake.functional.all_reduce(None) is world and fake.functional.gather(None) is world
    assert fake.functional.all_reduce.__defaults__ == (0, world)
    assert fake.functional.no_group(None) is None and fake.functional.imported(None) is None
    with pytest.raises(AttributeError):
        fake.torch.not_there  # noqa: B018 - other names still reach torch's hook
    fake.c10d.GroupMember.WORLD = object()  # a later group: the import happened once, the defaults stay
    assert fake.torch._dynamo is fake.dynamo and fake.functional.all_reduce(None) is world


def test_functional_group_defaults_untouched_when_the_forkserver_did_not_import_dynamo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_torch(monkeypatch, dynamo_imported=False)
    warm.defer_dynamo_import_effects()
    assert vars(fake.torch)["__getattr__"] is fake.lazy
    assert fake.functional.all_reduce.__defaults__ == (0, None)
