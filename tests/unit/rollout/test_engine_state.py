"""The rollout engine's sleep/wake/sync/generate order (rollout/sleep_state.py), and the
vLLM calls and training-memory offload the engine makes around it (with a stand-in for vLLM)."""

from types import SimpleNamespace

import pytest
import torch

from vapo_megatron.rollout.sleep_state import EngineStateError, SleepState

pytestmark = pytest.mark.unit


def cycle(state: SleepState, level: int) -> None:
    """The trainer's order: sleep, wake weights, sync, wake KV cache, generate."""
    state.sleep(level)
    state.wake("weights")
    state.begin_update()
    state.end_update(ok=True)
    state.wake("kv_cache")
    state.check_generate()


@pytest.mark.parametrize("level", [1, 2])
def test_the_right_order_works_repeatedly(level):
    state = SleepState()
    state.check_generate()  # a fresh engine is awake and holds its checkpoint's weights
    for _ in range(3):
        cycle(state, level)
    assert not state.asleep


def test_level_1_keeps_the_weights_without_a_sync():
    state = SleepState()
    state.sleep(1)
    state.wake("weights")
    state.wake("kv_cache")
    state.check_generate()


def test_level_2_needs_a_sync_before_the_kv_cache_and_generation():
    state = SleepState()
    state.sleep(2)
    state.wake("weights")
    with pytest.raises(EngineStateError, match="level-2"):
        state.wake("kv_cache")
    with pytest.raises(EngineStateError, match="sleeps"):
        state.check_generate()


@pytest.mark.parametrize("level", [1, 2])
def test_sync_into_a_sleeping_engine_is_an_error(level):
    state = SleepState()
    state.sleep(level)
    with pytest.raises(EngineStateError, match="sleeping engine"):
        state.begin_update()
    # The refusal changed nothing: the right order still works afterwards.
    state.wake("weights")
    state.begin_update()
    state.end_update(ok=True)
    state.wake("kv_cache")
    state.check_generate()


def test_generate_while_asleep_or_half_awake_is_an_error():
    state = SleepState()
    state.sleep(1)
    with pytest.raises(EngineStateError, match="weights offloaded"):
        state.check_generate()
    state.wake("weights")
    with pytest.raises(EngineStateError, match="KV cache asleep"):
        state.check_generate()


def test_kv_cache_before_weights_is_an_error():
    state = SleepState()
    state.sleep(1)
    with pytest.raises(EngineStateError, match="before wake_up\\('weights'\\)"):
        state.wake("kv_cache")


def test_double_sleep_and_bad_values():
    state = SleepState()
    with pytest.raises(ValueError, match="1 or 2"):
        state.sleep(3)
    state.sleep(1)
    with pytest.raises(EngineStateError, match="already"):
        state.sleep(1)
    with pytest.raises(ValueError, match="tags"):
        state.wake("activations")


def test_failed_sync_breaks_the_engine_for_good():
    state = SleepState()
    state.begin_update()
    with pytest.raises(EngineStateError, match="in progress"):
        state.check_generate()
    state.end_update(ok=False)
    for call in (state.check_generate, state.begin_update, lambda: state.sleep(1)):
        with pytest.raises(EngineStateError, match="failed midway"):
            call()


class Recorder:
    """Stands in for vLLM's LLM and the training offload: records the calls."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getattr__(self, method):
        return lambda *args, **kwargs: self.log.append((self.name, method, args, kwargs))


def fake_engine(*, is_cpu: bool, level: int, log: list):
    pytest.importorskip("vllm")  # generate imports vllm before it checks the state
    from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine

    engine = RolloutEngine.__new__(RolloutEngine)  # no vLLM engine: calls are recorded
    engine.config = RolloutConfig(model_path="unused", sleep_level=level)
    engine.is_cpu = is_cpu
    engine.state = SleepState()
    engine.llm = Recorder(log, "llm")
    engine.training_offload = Recorder(log, "offload")
    return engine


def rpc_name(entry) -> str:
    return entry[2][0].__name__ if entry[1] == "collective_rpc" else entry[1]


@pytest.mark.parametrize("level", [1, 2])
def test_gpu_engine_calls_vllm_and_offloads_in_order(level):
    log = []
    engine = fake_engine(is_cpu=False, level=level, log=log)
    engine.wake_up()  # awake already: nothing to do
    engine.sleep()
    engine.wake_up(["weights"])
    engine.state.begin_update()  # update_weights itself needs vLLM's workers
    engine.state.end_update(ok=True)
    engine.wake_up(["kv_cache"])
    engine.sleep()
    calls = [(who, rpc_name(entry)) for entry in log for who in [entry[0]]]
    save = [("llm", "save_unsaved_module_tensors")] if level == 2 else []
    restore = [("llm", "restore_unsaved_module_tensors")] if level == 2 else []
    assert calls == [
        *save,  # host copies of what level 2 discards and nothing restores
        ("llm", "sleep"),
        ("offload", "restore"),  # the training state back once the engine sleeps
        ("offload", "offload_for_weights"),  # all but the policy's parameters out first
        ("llm", "wake_up"),
        *restore,
        ("offload", "offload_policy_params"),  # the sync has read them: out before the KV
        ("llm", "wake_up"),
        *save,
        ("llm", "sleep"),
        ("offload", "restore"),
    ]
    assert [e[3] for e in log if e[1] == "sleep" and e[0] == "llm"] == [{"level": level}] * 2
    assert [entry[3]["tags"] for entry in log if entry[1] == "wake_up"] == [
        ["weights"],
        ["kv_cache"],
    ]


def test_the_trainer_sleeps_at_level_2_by_default(monkeypatch):
    """The trainer syncs every step, so its engines sleep at level 2 unless the recipe says 1
    (RolloutConfig's own default stays 1 for direct users, who may wake without a sync)."""
    pytest.importorskip("vllm")
    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.rollout import engine as engine_module
    from vapo_megatron.trainer import session

    seen = []
    monkeypatch.setattr(engine_module, "RolloutEngine", lambda config, **kw: seen.append(config))
    for overrides, level in (([], 2), (["rollout.sleep_level=1"], 1)):
        session.start_rollout(load_recipe("recipes/tiny_cpu.yaml", overrides), 0)
        assert seen.pop().sleep_level == level


def test_level_2_restores_module_tensors_vllm_does_not_save():
    """A tensor held as a plain module attribute (not a parameter, not a registered buffer)
    is saved before a level-2 sleep and copied back after the weights wake."""
    pytest.importorskip("vllm")
    from vapo_megatron.rollout.module_tensors import (
        restore_unsaved_module_tensors,
        save_unsaved_module_tensors,
        unsaved_module_tensors,
    )

    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model[0].register_buffer("inv_freq", torch.arange(3.0))
    model[0].cos_sin = torch.linspace(0, 1, 6)  # the kind vLLM's level 2 loses
    model[0].kv_cache = torch.zeros(4)  # vLLM binds the KV cache so: wakes empty, never saved
    assert list(unsaved_module_tensors(model)) == ["0.cos_sin"]
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    assert save_unsaved_module_tensors(worker) == 1
    want = model[0].cos_sin.clone()
    model[0].cos_sin.fill_(float("nan"))  # what a discarded allocation may hold on wake
    assert restore_unsaved_module_tensors(worker) == 1
    assert torch.equal(model[0].cos_sin, want)
    assert restore_unsaved_module_tensors(worker) == 0  # used once


def test_cpu_engine_calls_nothing_but_checks_the_order():
    log = []
    engine = fake_engine(is_cpu=True, level=1, log=log)
    engine.training_offload = None
    engine.sleep()
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.sleep()
    assert log == []  # no vLLM sleep mode on CPU
    with pytest.raises(EngineStateError, match="sleeps"):
        engine.generate([[1, 2]], max_new_tokens=1)
    with pytest.raises(EngineStateError, match="sleeping engine"):
        engine.update_weights([])


def built_engine_kwargs(monkeypatch, *, is_cpu: bool) -> dict:
    """The keyword arguments RolloutEngine passes to vLLM's LLM, on a GPU or a CPU platform
    (vLLM's LLM and platform stood in for; nothing is started)."""
    pytest.importorskip("vllm")
    import vllm
    import vllm.platforms

    from vapo_megatron.rollout import engine as engine_module

    seen = {}

    class LLM:
        def __init__(self, model, **kwargs):
            seen.update(kwargs)

        def collective_rpc(self, *args, **kwargs):
            return []

    import vapo_megatron.rollout.worker_extension  # noqa: F401 (imported on the real platform)

    monkeypatch.setattr(vllm, "LLM", LLM)
    monkeypatch.setattr(vllm.platforms.current_platform, "is_cpu", lambda: is_cpu)
    monkeypatch.setattr(engine_module.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_module.RolloutEngine(engine_module.RolloutConfig(model_path="unused"))
    return seen


def test_gpu_engine_offloads_its_cuda_graph_pool_while_asleep(monkeypatch):
    """vLLM 0.32 keeps the CUDA-graph pool on the GPU through sleep unless
    sleep_mode_offload_cudagraph (default False) is passed with sleep mode; every argument the
    engine passes is one vLLM 0.32 takes."""
    import dataclasses
    import inspect

    gpu = built_engine_kwargs(monkeypatch, is_cpu=False)
    assert gpu["enable_sleep_mode"] and gpu["sleep_mode_offload_cudagraph"]
    cpu = built_engine_kwargs(monkeypatch, is_cpu=True)
    assert not cpu["enable_sleep_mode"] and "sleep_mode_offload_cudagraph" not in cpu
    monkeypatch.undo()  # the real LLM again
    from vllm import LLM, EngineArgs

    taken = {f.name for f in dataclasses.fields(EngineArgs)}
    taken |= set(inspect.signature(LLM.__init__).parameters)
    assert set(gpu) <= taken, set(gpu) - taken
    default = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert default["sleep_mode_offload_cudagraph"] is False


def test_shutdown_frees_the_offload_arena_once_the_state_is_back():
    log = []
    engine = fake_engine(is_cpu=False, level=2, log=log)
    core = SimpleNamespace(shutdown=lambda: log.append(("llm", "shutdown", (), {})))
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    engine.training_offload.offloaded = False
    engine.shutdown()
    assert [(who, method) for who, method, *_ in log] == [
        ("llm", "shutdown"),
        ("offload", "release"),
    ]
    log.clear()
    engine.training_offload.offloaded = True  # a failure mid-rollout: the state is on the host
    engine.shutdown()
    assert [(who, method) for who, method, *_ in log] == [("llm", "shutdown")]
