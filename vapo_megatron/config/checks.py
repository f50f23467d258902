"""The checks :meth:`TrainConfig.check` runs: each refuses one kind of combination that cannot
run, with a ValueError naming the values and the fix. Also how the critic can be given a start.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.config.layout import layout_sizes
from vapo_megatron.config.mtp import check_mtp_fits

if TYPE_CHECKING:  # train.py imports this module to run the checks
    from vapo_megatron.config.layout import ModelShape
    from vapo_megatron.config.train import TrainConfig


def check_layouts_fit(config: TrainConfig, world_size: int) -> None:
    """Each model's tp * pp * cp divides the ranks that train, and vLLM's tensor parallelism
    the ranks that generate: the whole job of ``world_size`` ranks colocated; in the separate
    placement its rollout.ranks ranks generate and the others train."""
    rollout_ranks = config.rollout.rollout_world(world_size)  # checks rollout.ranks
    if rollout_ranks:
        world_size -= rollout_ranks
    layouts = [("policy", config.policy.layout)]
    if config.algorithm.uses_critic:
        layouts.append(("critic", config.critic.layout))
    for name, layout in layouts:
        ranks = layout.tp * layout.pp * layout.cp
        if world_size % ranks:
            which = (
                f"the {world_size} trainer ranks"
                if rollout_ranks
                else f"the world size {world_size}"
            )
            raise ValueError(
                f"{name}.layout needs tp * pp * cp = {ranks} ranks per replica, which does "
                f"not divide {which}; change {name}.layout or the number "
                "of ranks (trainer.local_world_size when started plainly, rollout.ranks)"
            )
    rollout_tp = config.rollout.tensor_parallel_size
    if not rollout_ranks and world_size % rollout_tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={rollout_tp} does not divide the "
            f"world size {world_size}; each group of that many ranks forms one vLLM engine"
        )


def check_layouts_on_models(
    config: TrainConfig, models: Mapping[str, tuple[str, ModelShape]], world_size: int
) -> None:
    """Each model's layout fits its model (heads, layers, experts: ``ModelLayout.check``) and
    its expert groups fit the world, naming the setting and the model. ``models``: "policy"
    and, with a critic, "critic" -> (HF directory, its config); a model not in it (not yet
    written: model.create_tiny) is checked by the ranks once it is. The model comes first: an
    ep on a dense model is that, not an arithmetic problem."""
    roles = ["policy", "critic"] if config.algorithm.uses_critic else ["policy"]
    for role in roles:
        layout = getattr(config, role).layout
        if role in models:
            path, hf = models[role]
            try:
                layout.check(hf, name=f"{role}.layout", model=path)
            except ValueError as err:
                named = str(err).startswith(f"{role}.layout")
                raise ValueError(str(err) if named else f"{role}.layout ({path}): {err}") from None
            if role == "policy":
                check_mtp_fits(
                    config.policy.mtp, mtp_num_layers=hf.mtp_num_layers, vpp=layout.vpp,
                    cp=layout.cp, model=path,
                )  # fmt: skip
        try:
            layout_sizes(
                tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world_size,
                ep=layout.ep, etp=layout.etp,
            )  # fmt: skip
        except ValueError as err:
            raise ValueError(f"{role}.layout: {err}") from None


def check_batches(config: TrainConfig) -> None:
    """Mini-batches divide the step's samples; steps, epochs and micro-batch budgets count."""
    trainer = config.trainer
    if trainer.mini_batch_size < 1 or config.samples_per_step % trainer.mini_batch_size:
        raise ValueError(
            f"trainer.mini_batch_size={trainer.mini_batch_size} must divide the step's "
            f"samples (algorithm.prompts_per_step x samples_per_prompt = "
            f"{config.samples_per_step}); pick a divisor"
        )
    if trainer.steps < 0 or trainer.ppo_epochs < 1 or trainer.micro_batch_tokens < 1:
        raise ValueError(
            f"trainer.steps must be >= 0 and ppo_epochs, micro_batch_tokens >= 1; got "
            f"{trainer.steps}, {trainer.ppo_epochs}, {trainer.micro_batch_tokens}"
        )


def check_lengths(config: TrainConfig) -> None:
    """A prompt and its response fit the engine; the overlong buffer fits the response."""
    algo, rollout, data = config.algorithm, config.rollout, config.data
    if data.max_prompt_tokens + rollout.max_new_tokens > rollout.max_model_len:
        raise ValueError(
            f"data.max_prompt_tokens ({data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({rollout.max_new_tokens}) exceeds rollout.max_model_len "
            f"({rollout.max_model_len}); raise max_model_len or lower one of the others"
        )
    if algo.overlong_buffer_len is not None and algo.overlong_buffer_len > rollout.max_new_tokens:
        raise ValueError(
            f"algorithm.overlong_buffer_len={algo.overlong_buffer_len} exceeds "
            f"rollout.max_new_tokens={rollout.max_new_tokens}; lower it or set it to null"
        )


def check_eval(config: TrainConfig) -> None:
    """Evaluation during training has prompts and samples."""
    if (config.eval.every or config.eval.at_start) and not config.data.eval_path:
        raise ValueError("eval.every / eval.at_start need data.eval_path; set it or disable eval")
    if config.eval.k < 1:
        raise ValueError(f"eval.k must be >= 1, got {config.eval.k}")


def check_tiny_task(config: TrainConfig) -> None:
    """The tiny task's warm-up rates are fractions."""
    model = config.model
    for name, rate, what in (
        ("tiny_slip_rate", model.tiny_slip_rate, "worked lines that slip"),
        ("tiny_guess_rate", model.tiny_guess_rate, "solutions that are guesses"),
    ):
        if not 0.0 <= rate < 1.0:
            raise ValueError(
                f"model.{name}={rate} must be in [0, 1): the fraction of the warm-up's {what}"
            )


def check_sampling(config: TrainConfig) -> None:
    """Temperatures are >= 0 and top_p in (0, 1]; several samples of a prompt are not all the
    same greedy response; the policy's updates read log-probs at a temperature > 0."""
    rollout, samples = config.rollout, config.algorithm.samples_per_prompt
    for name, temperature, top_p in (
        ("rollout", rollout.temperature, rollout.top_p),
        ("eval", config.eval.temperature, config.eval.top_p),
    ):
        if not temperature >= 0:  # NaN too
            raise ValueError(
                f"{name}.temperature={temperature} is not a temperature: give one > 0 (1.0 "
                "samples the policy as it is, lower sharpens it) or 0 for greedy decoding"
            )
        if not 0 < top_p <= 1:
            raise ValueError(
                f"{name}.top_p={top_p} must be in (0, 1]: the probability mass nucleus "
                "sampling keeps (1.0 keeps every token)"
            )
    if rollout.temperature == 0 and samples > 1:
        raise ValueError(
            f"rollout.temperature=0 is greedy: all {samples} samples of a prompt would be the "
            "same; use a temperature > 0 or algorithm.samples_per_prompt=1"
        )
    if rollout.temperature == 0 and config.trainer.steps:
        raise ValueError(
            "rollout.temperature=0 is greedy, but the policy's updates need its log-probs at "
            "the sampling temperature, which greedy decoding has none of: use a temperature "
            f"> 0 (every recipe's is 1.0), or trainer.steps=0 (critic pretraining only; "
            f"trainer.steps={config.trainer.steps})"
        )


def critic_has_own_model(config: TrainConfig) -> bool:
    """Whether critic.model names another model than the policy's (model.path)."""
    model = config.critic.model
    return model is not None and Path(model).resolve() != Path(config.model.path).resolve()


def check_critic_init(config: TrainConfig) -> None:
    """A critic started from a reward model is told where it is: critic.init_path, or
    critic.model when that is the critic's own model."""
    algo, critic = config.algorithm, config.critic
    if (
        algo.uses_critic
        and algo.critic_init == "reward_model"
        and not (critic.init_path or critic.pretrained or critic_has_own_model(config))
    ):
        raise ValueError(
            "algorithm.critic_init=reward_model needs critic.init_path (a reward model: "
            "tools/convert.py hf-to-mcore --critic-from reward-model, or an HF "
            "*ForSequenceClassification directory) or critic.model (a reward model's HF "
            "directory); set one, or set algorithm.critic_init=policy to start the critic "
            f"from the policy's weights (algorithm.critic_init takes {critic_init_values()})"
        )


def check_critic_model_setting(config: TrainConfig) -> None:
    """A critic of its own model cannot start from the policy's weights; the tiny reward
    model is written at critic.model."""
    algo, critic = config.algorithm, config.critic
    if not algo.uses_critic:
        return
    own = critic_has_own_model(config)
    if own and algo.critic_init == "policy":
        raise ValueError(
            f"algorithm.critic_init=policy starts the critic from the policy's weights, but "
            f"critic.model={critic.model} is another model than model.path={config.model.path} "
            "(a value head on another model's trunk cannot start from the policy's weights): "
            "set algorithm.critic_init=reward_model (weights from critic.model or "
            "critic.init_path), or drop critic.model to use the policy's model"
        )
    if critic.create_tiny and not own:
        raise ValueError(
            "critic.create_tiny writes a tiny reward model at critic.model, which must be a "
            f"directory other than model.path ({config.model.path}); set critic.model"
        )


def check_critic_context(config: TrainConfig, max_positions: int, model: str) -> None:
    """The critic's context covers the longest prompt and response it scores."""
    data, rollout = config.data, config.rollout
    need = data.max_prompt_tokens + rollout.max_new_tokens
    if max_positions < need:
        raise ValueError(
            f"the critic's model {model} has max_position_embeddings={max_positions}, less "
            f"than data.max_prompt_tokens ({data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({rollout.max_new_tokens}) = {need}: it would score positions it has no "
            "context for. Choose a critic.model with a longer context, or lower those lengths"
        )


def check_gae_path(gae_path: object) -> None:
    """trainer.gae_path was removed (issue 28): the step has one data path for any pair of
    layouts. The recipe loader calls this for the key (``recipe.REMOVED_KEYS``) instead of
    offering it among the valid ones. null, and "auto" (what resolved configs of earlier runs
    hold), are accepted with a deprecation warning; "shards"/"flat" asked for a path that is
    gone: an error."""
    if gae_path in (None, "auto"):
        logging.getLogger("vapo_megatron").warning(
            "trainer.gae_path is deprecated and ignored: every step takes the routed path "
            "(step/advantage_exchange.py); delete the key"
        )
        return
    raise ValueError(
        f"trainer.gae_path={gae_path!r}: the setting was removed (issue 28); every step takes "
        "one routed path (each model trains on its own DP ranks' samples, the critic's "
        "advantages go to the policy's; step/advantage_exchange.py) and the flat path is gone; "
        "delete trainer.gae_path from the recipe"
    )


def check_loop(config: TrainConfig) -> None:
    """The loop's collective timeout and checkpoint count are valid."""
    trainer = config.trainer
    if trainer.dist_timeout_minutes <= 0:
        raise ValueError(
            f"trainer.dist_timeout_minutes must be > 0, got {trainer.dist_timeout_minutes}"
        )
    if trainer.keep_last < 1:
        raise ValueError(f"trainer.keep_last must be >= 1, got {trainer.keep_last}")


def critic_start_help(config: TrainConfig, *, rm_dir: str = "RM_DIR") -> str:
    """The two ways to give the critic a start, as commands for this recipe's model and layout
    (the paper's own reward model is not public; docs/cluster.md lists public ones). ``rm_dir``:
    the HF directory of the reward model, where known."""
    path, layout = config.critic.init_path, config.critic.layout
    convert = f"python tools/convert.py hf-to-mcore --tp {layout.tp} --pp {layout.pp}"
    return (
        f"either convert a reward model (a one-label *ForSequenceClassification of any "
        f"supported size with the policy's tokenizer; critic.model=its HF directory when it is "
        f"not the policy's model): `{convert} --hf {rm_dir} --out {path} "
        f"--critic-from reward-model` with algorithm.critic_init=reward_model; or start the "
        f"critic from the policy: `{convert} --hf {config.model.path} --out CRITIC_DIR "
        "--critic-from policy` with algorithm.critic_init=policy critic.init_path=CRITIC_DIR "
        "(value pretraining then starts from a zero value head: give it more steps, "
        f"algorithm.value_pretrain_steps). algorithm.critic_init takes {critic_init_values()} "
        "(convert's --critic-from spells the first reward-model)"
    )


def critic_init_values() -> str:
    """algorithm.critic_init's accepted values, as a recipe or an override writes them."""
    values = typing.get_args(typing.get_type_hints(AlgoConfig)["critic_init"])
    return " or ".join(values)


def check_critic_start(config: TrainConfig, *, has_pretrained_critic: bool = False) -> None:
    """ValueError, naming both ways out, when the critic would start from a critic.init_path
    that is not there. Nothing to check without a critic, or when a pretrained critic (this
    run's, or critic.pretrained) is used instead."""
    path = config.critic.init_path
    if not config.algorithm.uses_critic or has_pretrained_critic or config.critic.pretrained:
        return
    if path is None or Path(path).exists():
        return
    raise ValueError(
        f"critic.init_path={path} does not exist (algorithm.critic_init="
        f"{config.algorithm.critic_init}): {critic_start_help(config)}"
    )
