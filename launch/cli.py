"""`odmoe-launch`: the Hydra entry point for every role.

    odmoe-launch role=local max_new_tokens=32                      # whole cluster on this machine
    odmoe-launch role=local --prompt 'def f(x="a, b"):'            # any text, no Hydra grammar
    odmoe-launch role=local --prompt-file prompt.py                # or --prompt - (stdin)
    odmoe-launch role=worker worker.index=0 model.path=DIR cluster=lan_example
    odmoe-launch role=main model.path=DIR cluster=lan_example
    odmoe-launch role=ray model.path=DIR cluster.workers=4          # placed on a running Ray cluster
    odmoe-launch role=plan model.path=DIR cluster.workers=4         # each node's memory need, nothing loaded
    odmoe-launch role=seed model.path=DIR cluster.join_port=50053  # serve DIR's bytes to nodes that pull
    odmoe-launch role=worker worker.index=1 model.pull_from=HOST:50053 ...  # pull this worker's share first
    odmoe-launch role=main model.path=DIR cluster.workers=2 cluster.join_port=50053  # prints a join line
    odmoe-launch join=odmoe://SECRET@HOST:50053/FINGERPRINT        # a box joins by that line

Every word is a Hydra override except `--prompt TEXT`, `--prompt-file FILE` and `--prompt -`: they
are taken out of the command line before Hydra parses it, and the text is set on the config as it
is (parentheses, quotes, `=`, newlines, any unicode), never through Hydra's override grammar. A
`prompt=...` word Hydra cannot parse gets a hint pointing at `--prompt` instead of Hydra's error.

Exit codes: 0 success, 2 bad configuration or input, 1 anything else (the message says which node).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from odmoe.launch.settings import lab_refusal, to_config
from odmoe.validation import exposed_hosts

log = logging.getLogger("odmoe.launch")
BAD_INPUT = 2
PROMPT_HINT = (
    "put the prompt after --prompt instead, as plain text (the shell's quotes only):\n"
    "    odmoe-launch role=local --prompt {quoted}\n"
    "    odmoe-launch role=local --prompt-file prompt.txt   (or --prompt - to read standard input)"
)
# The prompt taken from --prompt / --prompt-file for the Hydra job below. A module global because
# hydra.main owns the call into _launch; set once by main() before Hydra starts.
_prompt: str | None = None


class PromptArgumentError(ValueError):
    """--prompt / --prompt-file without a value, given twice, or naming an unreadable file."""


def take_prompt(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the prompt text or None, argv without the prompt options). `--prompt TEXT`, `--prompt=TEXT`,
    `--prompt -` (standard input), `--prompt-file FILE`, `--prompt-file=FILE`; text taken exactly."""
    prompt, rest, words = None, [], iter(argv)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag not in ("--prompt", "--prompt-file"):
            rest.append(word)
            continue
        if not eq:
            value = next(words, None)
            if value is None:
                raise PromptArgumentError(f"{flag} needs a value")
        if prompt is not None:
            raise PromptArgumentError("give the prompt once (--prompt or --prompt-file)")
        prompt = _read_prompt(flag, value)
    return prompt, rest


def _read_prompt(flag: str, value: str) -> str:
    if flag == "--prompt" and value != "-":
        return value
    try:
        if value == "-":
            return sys.stdin.read()
        return Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptArgumentError(f"{flag} {value}: {exc}") from exc


def unparsable_prompt(argv: list[str]) -> str | None:
    """The first `prompt=...` word Hydra's override grammar rejects, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for word in argv:
        if word.lstrip("+").startswith("prompt="):
            try:
                parser.parse_overrides([word])
            except HydraException:
                return word
    return None


def main() -> None:
    global _prompt
    try:
        _prompt, sys.argv[1:] = take_prompt(sys.argv[1:])
    except PromptArgumentError as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        sys.exit(BAD_INPUT)
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print(__doc__.split("\n\nExit codes")[0])  # the usage and --prompt; Hydra's help follows
    bad = unparsable_prompt(sys.argv[1:])
    if bad is not None:
        hint = PROMPT_HINT.format(quoted=shlex.quote(bad.partition("=")[2]))
        print(f"odmoe-launch: Hydra cannot parse {bad!r} as an override;\n{hint}", file=sys.stderr)
        sys.exit(BAD_INPUT)
    if (refusal := lab_refusal(sys.argv[1:])) is not None:
        print(f"odmoe-launch: {refusal}", file=sys.stderr)
        sys.exit(BAD_INPUT)
    _launch()


@hydra.main(config_path="pkg://odmoe.conf", config_name="config", version_base="1.3")
def _launch(raw: DictConfig) -> None:
    if _prompt is not None:
        raw.prompt = _prompt  # set as a value: no override grammar involved
    try:
        cfg = to_config(raw)
    except ValueError as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        sys.exit(BAD_INPUT)
    _set_up_process(cfg)
    from odmoe.launch.roles import run_local, run_main, run_plan, run_ray, run_seed, run_shadow, run_worker

    roles = {
        "local": run_local,
        "main": run_main,
        "worker": run_worker,
        "shadow": run_shadow,
        "ray": run_ray,
        "plan": run_plan,
        "seed": run_seed,
    }
    overrides = list(HydraConfig.get().overrides.task)
    if cfg.join:  # a box joining by main's link: main names its role
        from odmoe.launch.join import run_join

        sys.exit(run_join(cfg, overrides))
    code = roles[cfg.role.name](cfg, overrides)
    if code:  # returning (not exiting) on success lets a -m multirun go on to its next job
        sys.exit(code)


def _set_up_process(cfg) -> None:
    """This process as `cfg` asks: its logging, torch's threads, the CPUs it may run on."""
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    # bitsandbytes warns on every CPU int8 matmul (an int8 shadow) that it casts inputs to fp16
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if cfg.cluster.torch_threads > 0:
        import torch

        torch.set_num_threads(cfg.cluster.torch_threads)
    if cfg.cluster.cpus:
        try:
            os.sched_setaffinity(0, cfg.cluster.cpus)
        except (OSError, ValueError) as exc:
            print(f"odmoe-launch: cluster.cpus={cfg.cluster.cpus}: {exc}", file=sys.stderr)
            sys.exit(BAD_INPUT)
        for thread in os.listdir("/proc/self/task"):  # threads imports started; later ones inherit it
            with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
                os.sched_setaffinity(int(thread), cfg.cluster.cpus)
    if not cfg.security.enabled and (exposed := exposed_hosts(cfg)):  # allowed by security.insecure_lan
        logging.getLogger("odmoe.transport.security").warning(
            "SECURITY IS OFF on %s: anyone on that network can send this node work or read what it "
            "sends (security.enabled=false, security.insecure_lan=true)",
            ", ".join(exposed),
        )


if __name__ == "__main__":
    main()
