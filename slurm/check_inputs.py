"""Check a recipe's inputs before a job is submitted (``DRY_RUN=1 bash slurm/vapo_qwen32b.sh``).

    python slurm/check_inputs.py RECIPE [section.key=value ...] [--hf-model ID] [--reward-model ID]

One line per input: ``ok`` with what was found (data files are read as the trainer reads them,
rows, graders and tokenized lengths included, and print their counts; the model directory has a config and a tokenizer; the policy and
critic checkpoints are vapo-megatron checkpoints of this model with the right head), or
``MISSING`` / ``BAD`` with the command that makes it. The last line is JSON
``{"ok": bool, "missing": [...]}``. Exit status: 0 all present, 2 something missing or bad.
``--hf-model`` / ``--reward-model`` name the Hugging Face ids the commands download.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")

from vapo_megatron.checkpoint import model as mckpt  # noqa: E402
from vapo_megatron.config.checks import critic_start_help  # noqa: E402
from vapo_megatron.config.recipe import load_recipe  # noqa: E402
from vapo_megatron.config.train import TrainConfig  # noqa: E402
from vapo_megatron.data.prompts import load_prompts  # noqa: E402
from vapo_megatron.models.config import HFModelConfig  # noqa: E402
from vapo_megatron.rewards.registry import resolve_routing  # noqa: E402
from vapo_megatron.weights import hf_io  # noqa: E402
from vapo_megatron.weights.critic import (  # noqa: E402
    check_critic_model,
    critic_model_config,
    critic_model_path,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""Any one of these makes a directory hold a tokenizer (with tokenizer_config.json or alone)."""
DATASETS = {
    "train_path": ("dapo-math-17k", "BytedTsinghua-SIA/DAPO-Math-17k"),
    "eval_path": ("aime-2024", "BytedTsinghua-SIA/AIME-2024"),
}
"""data.<key> -> the tools/prepare_data.py command and the public source that makes it."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_inputs.py", description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--hf-model", default="HF_MODEL_ID", help="HF id of model.path")
    parser.add_argument("--reward-model", default="", help="HF id of a public reward model")
    args = parser.parse_args(argv)
    try:
        config = load_recipe(args.recipe, args.overrides)
    except ValueError as err:
        print(f"BAD      recipe {args.recipe}: {err}")
        print(json.dumps({"ok": False, "missing": ["recipe"]}))
        return 2
    checker = Checker(config, args.hf_model, args.reward_model)
    checker.run()
    print(json.dumps({"ok": not checker.missing, "missing": checker.missing}))
    return 2 if checker.missing else 0


class Checker:
    """Collects one line per input; ``missing`` names the inputs to make."""

    def __init__(self, config: TrainConfig, hf_model: str, reward_model: str) -> None:
        self.config = config
        self.hf_model = hf_model
        self.reward_model = reward_model
        self.missing: list[str] = []
        self.hf: HFModelConfig | None = None
        self.tokenizer = None

    def run(self) -> None:
        self.model_dir()
        for key in DATASETS:
            self.data_file(key)
        self.policy()
        if self.config.algorithm.uses_critic:
            self.critic()

    def ok(self, what: str, detail: str) -> None:
        print(f"ok       {what}: {detail}")

    def fail(self, kind: str, what: str, detail: str) -> None:
        print(f"{kind:<8} {what}: {detail}")
        self.missing.append(what.split("=")[0])

    def model_dir(self) -> None:
        path = Path(self.config.model.path)
        what = f"model.path={path}"
        fetch = f"hf download {self.hf_model} --local-dir {path}"
        if not (path / hf_io.CONFIG_NAME).is_file():
            self.fail("MISSING", what, f"no {hf_io.CONFIG_NAME}; download it: {fetch}")
            return
        try:
            self.hf = HFModelConfig.from_hf(hf_io.read_config(path))
        except ValueError as err:
            self.fail("BAD", what, str(err))
            return
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            self.fail("MISSING", what, f"no tokenizer ({', '.join(TOKENIZER_FILES)}): {fetch}")
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        hf = self.hf
        self.ok(what, f"{hf.family}, {hf.num_layers} layers, hidden {hf.hidden_size}, tokenizer")

    def data_file(self, key: str) -> None:
        data = self.config.data
        path = getattr(data, key)
        if path is None:
            return
        what = f"data.{key}={path}"
        command, source = DATASETS[key]
        make = f"python tools/prepare_data.py {command} --source {source} --out {path}"
        if not Path(path).is_file():
            self.fail("MISSING", what, make)
            return
        try:
            if self.tokenizer is None:  # no model here: the rows alone
                _, report = load_prompts(
                    path,
                    default_data_source=data.default_data_source,
                    dedup=data.dedup,
                    max_bad_fraction=data.max_bad_fraction,
                )
                detail = (
                    f"{report.num_rows} rows, {report.num_duplicates} duplicates, "
                    f"{report.num_skipped} skipped, {report.num_kept} prompts (not tokenized)"
                )
            else:  # as the trainer reads it: rows, graders by data_source, template, length
                # The trainer's session imports megatron; only this check, with a tokenizer,
                # pays for it (the recipe and the checkpoints' metadata are read without).
                from vapo_megatron.trainer.session import import_plugins, read_prompts

                import_plugins(self.config.reward.plugins)
                routing = resolve_routing(self.config.reward.routing)
                prompts = read_prompts(self.config, path, self.tokenizer, routing)
                detail = prompts.report.removeprefix(f"{path}: ")
        except ValueError as err:
            self.fail("BAD", what, f"{err}; remake it: {make}")
            return
        self.ok(what, detail)

    def checkpoint(
        self, what: str, path: Path, head: str, make: str, layout, hf: HFModelConfig | None
    ) -> None:
        """A vapo-megatron checkpoint of model ``hf`` with this head; its layout is reported
        (a checkpoint saved at another TP/PP loads resharded)."""
        if not path.exists():
            self.fail("MISSING", what, make)
            return
        if not (path / mckpt.METADATA_NAME).is_file() and head == "value":
            try:  # the trainer also takes an HF *ForSequenceClassification directory
                names = hf_io.HFCheckpoint(path).names
            except ValueError as err:
                self.fail("BAD", what, f"{err}; make it: {make}")
                return
            if "score.weight" not in names:
                self.fail("BAD", what, f"an HF model without score.weight; make it: {make}")
                return
            self.ok(what, "HF reward model (score.weight), converted at start")
            return
        try:
            meta = mckpt.load_metadata(path)
            if hf is not None:
                mckpt.check_compatible(meta, hf, head, path)
        except ValueError as err:
            self.fail("BAD", what, f"{err}; make it: {make}")
            return
        saved = f"{meta.architecture}, saved at tp {meta.tp} pp {meta.pp}, {meta.dtype}"
        if (meta.tp, meta.pp) != (layout.tp, layout.pp):
            saved += f" (the recipe's tp {layout.tp} pp {layout.pp}: resharded on load)"
        self.ok(what, saved)

    def policy(self) -> None:
        config = self.config
        if config.policy.load is None:
            self.ok("policy.load", f"unset: the policy starts from {config.model.path}")
            return
        path = Path(config.policy.load)
        layout = config.policy.layout
        make = (
            f"python tools/convert.py hf-to-mcore --hf {config.model.path} --out {path} "
            f"--tp {layout.tp} --pp {layout.pp}"
        )
        self.checkpoint(f"policy.load={path}", path, "lm", make, layout, self.hf)

    def critic_model(self) -> HFModelConfig | None:
        """The critic's model: the policy's, or critic.model with the trainer's start checks
        (its config, the policy's tokenizer, vocabulary and a long enough context)."""
        config = self.config
        if not config.critic.model:
            return self.hf
        what = f"critic.model={config.critic.model}"
        try:
            hf = critic_model_config(config)
            if self.hf is not None:
                check_critic_model(config)
        except ValueError as err:
            kind = "BAD" if Path(config.critic.model).exists() else "MISSING"
            self.fail(kind, what, str(err))
            return None
        self.ok(what, f"{hf.family}, {hf.num_layers} layers, hidden {hf.hidden_size}")
        return hf

    def critic(self) -> None:
        config = self.config
        hf, layout = self.critic_model(), config.critic.layout
        if config.critic.pretrained:
            path = Path(config.critic.pretrained)
            make = "point it at a run's critic_pretrained directory"
            self.checkpoint(f"critic.pretrained={path}", path, "value", make, layout, hf)
            return
        if config.critic.init_path is None:
            start = critic_model_path(config)
            self.ok("critic.init_path", f"unset: the critic starts from {start}")
            return
        path = Path(config.critic.init_path)
        what = f"critic.init_path={path}"
        if path.exists():
            self.checkpoint(what, path, "value", critic_start_help(config), layout, hf)
            return
        make = critic_start_help(config)
        if self.reward_model and config.algorithm.critic_init == "reward_model":
            rm_dir = path.parent / self.reward_model.split("/")[-1]
            make = (
                f"hf download {self.reward_model} --local-dir {rm_dir}, then "
                + critic_start_help(config, rm_dir=str(rm_dir))
            )
        self.fail("MISSING", what, make)


if __name__ == "__main__":
    sys.exit(main())
