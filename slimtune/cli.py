"""slimtune's command line: train | plan | probe | export | simulate | chat | eval, and --version.
`slimtune train` with no config runs the demo."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

from slimtune.run import interrupts
from slimtune.errors import UserError

TRAIN_EPILOG = """\
Settings (YAML keys; override any of them as key=value, e.g. train.steps=50 lora.rank=8):
{fields}

Example config (configs/ has more):
  model: path/to/hf-folder
  data: {{path: data/train.jsonl, format: chat, max_length: 512}}
  method: lora
  lora: {{rank: 16, alpha: 32, targets: all-linear}}
  train: {{steps: 100, batch_size: 4, lr: 2.0e-4}}
  output_dir: runs/demo

With no config at all, `slimtune train` runs the built-in demo (tiny model, CPU, ~2 minutes).
"""


class _Command(argparse.ArgumentParser):
    """A command's parser that adds its arguments when first used: to parse, or to say its help or
    usage. Some need heavy imports (train's help lists every registered engine's settings, simulate's
    options are the roundpipe engine's), which `slimtune --version` and the other commands never pay."""

    def __init__(self, *args, arguments: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._arguments = arguments

    def _add_arguments(self) -> None:
        arguments, self._arguments = self._arguments, None
        if arguments is not None:
            arguments(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_arguments()
        return super().parse_known_args(args, namespace)

    def parse_known_intermixed_args(self, args=None, namespace=None):
        self._add_arguments()
        return super().parse_known_intermixed_args(args, namespace)

    def format_usage(self) -> str:
        self._add_arguments()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_arguments()
        return super().format_help()


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's own parser by name (its arguments added when used)."""
    parser = argparse.ArgumentParser(prog="slimtune", description="Fine-tune language models that do not fit on your GPU.")
    parser.add_argument("--version", action="version", version=f"slimtune {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Command)
    sub.add_parser("train", help="fine-tune from a YAML config (no config: run the demo)", allow_abbrev=False,
                   formatter_class=argparse.RawDescriptionHelpFormatter, arguments=_add_train)
    sub.add_parser("plan", help="what fits a GPU and what runs fastest, from the real step on fake tensors",
                   arguments=_add_plan)
    sub.add_parser("probe", help="measure this machine's device and write a GPU profile", arguments=_add_probe)
    sub.add_parser("simulate", help="RoundPipe's schedule beside GPipe and 1F1B: bubble and step time, simulated",
                   arguments=_add_simulate)
    sub.add_parser("export", help="a run's model merged: an HF folder (--merge) or a GGUF file for llama.cpp and Ollama"
                   " (--gguf)", arguments=_add_export)
    sub.add_parser("chat", help="talk to a trained model in the terminal, answers streamed as they come",
                   arguments=_add_chat)
    sub.add_parser("eval", help="loss, perplexity and exact match of greedy answers on a data file",
                   arguments=_add_eval)
    return parser, sub.choices


def _add_train(train: argparse.ArgumentParser) -> None:
    from slimtune.engines import settings

    # Wrapped to a terminal's width; to a pipe or a file one line a key, whole (grep finds a help in one piece).
    width = max(shutil.get_terminal_size().columns, 80) if sys.stdout.isatty() else None
    train.epilog = TRAIN_EPILOG.format(fields="\n".join(settings.help_text(width=width)))
    train.add_argument("config", nargs="?", help="run config (YAML)")
    train.add_argument("overrides", nargs="*", help="key=value settings applied over the config")
    train.add_argument("--no-progress", action="store_true",
                       help="no progress bar: a line after the first and last step and at most every 30 s instead"
                            " (metrics still go to metrics.jsonl)")
    train.add_argument("--gpu", help="with plan=auto: the card to plan for (same as gpu=...)")
    train.add_argument("--nproc", type=int, help="train with data parallelism on this many processes on this machine"
                       " (torchrun --standalone --nproc-per-node N; one per GPU on CUDA). Several machines: see docs/data-parallel.md")


def _add_plan(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--model", required=True, help="a preset name (e.g. Llama-3.1-8B), a local HF folder, or a"
                      " Hub name (org/name: its config.json alone is fetched)")
    plan.add_argument("--gpu", required=True, help="a card name (rtx4090, h100, ...), a size (24GiB) or a probe JSON")
    plan.add_argument("--seq", type=int, default=2048, help="tokens per row (default 2048)")
    plan.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    plan.add_argument("--method", choices=("lora", "full"), default="lora",
                      help="lora (adapters over a frozen, possibly 4-bit base) or full fine-tuning (default lora)")
    plan.add_argument("--rank", type=int, help="LoRA rank (default 16; --method lora only)")
    plan.add_argument("--gpus", "--gpus-per-node", dest="gpus", type=int, default=1,
                      help="cards of that kind per machine (default 1): one rank each under data parallelism, or one"
                           " worker each for an engine that uses several (roundpipe)")
    plan.add_argument("--nodes", type=int, default=1,
                      help="machines alike, trained together with torchrun (default 1); figures stay per device")
    plan.add_argument("--host-ram", help="the host's RAM to plan for, e.g. 64GiB (default: this machine's)")
    plan.add_argument("--disk", help="free disk to plan for, e.g. 500GB (decimal, as disks are sold; 500GiB is"
                      " binary; default: free here)")
    plan.add_argument("--max-seq", nargs="?", type=int, const=0, default=None, metavar="LIMIT",
                      help="also find each plan's longest sequence that fits, up to the model's positions or LIMIT"
                           " tokens (beyond them: for a run that extends its RoPE)")
    plan.add_argument("--detail", action="store_true", help="add the device peak's breakdown to the table")
    plan.add_argument("--json", action="store_true", help="print the plans as a JSON list")
    plan.add_argument("--png", metavar="FILE", help="also draw the plans' memory against the card as a PNG picture")


def _add_probe(probe: argparse.ArgumentParser) -> None:
    probe.add_argument("--out", help="write the profile here (JSON, usable as --gpu FILE)")


def _add_simulate(simulate: argparse.ArgumentParser) -> None:
    from slimtune.engines.roundpipe import simulate as pipeline_simulate

    pipeline_simulate.add_arguments(simulate)


def _add_export(export: argparse.ArgumentParser) -> None:
    export.add_argument("run_dir", help="the run's output_dir")
    export.add_argument("--merge", action="store_true", help="merge the adapter into the base weights: an HF folder")
    export.add_argument("--out", help="with --merge: destination folder (default: RUN_DIR/merged)")
    export.add_argument("--gguf", metavar="FILE", help="write the trained model (LoRA: merged) as one GGUF file, with"
                        " its tokenizer and chat template, for llama.cpp, Ollama and LM Studio")
    export.add_argument("--gguf-type", choices=("f16", "bf16", "q8_0"), default="f16",
                        help="with --gguf: the weights' type (default f16; q8_0: 8-bit, about half the size)")


RUN_DIR_HELP = ("a run's output_dir (LoRA: its adapter over the base, nothing merged), an adapter folder, an HF "
                "model folder or a Hub model's name (org/name)")
DEVICE_HELP = "auto (default: CUDA when present), cpu, cuda, cuda:N"


def _add_chat(chat: argparse.ArgumentParser) -> None:
    from slimtune.serve.chat import STYLES

    chat.add_argument("run_dir", help=RUN_DIR_HELP)
    chat.add_argument("--prompt", help="answer this one message, then exit")
    chat.add_argument("--system", help="a system message opening the conversation (chat style)")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    chat.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    chat.add_argument("--template", choices=STYLES, default="auto",
                      help="chat: the turns through the chat template; plain: each message alone as a prompt; auto "
                           "(default): plain for runs trained on prompt_response or text data and for models "
                           "without a template, else chat")
    chat.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)


def _add_eval(evaluate: argparse.ArgumentParser) -> None:
    from slimtune.serve.evaluate import ANSWER_SLACK, FORMATS

    evaluate.add_argument("run_dir", help=RUN_DIR_HELP)
    evaluate.add_argument("overrides", nargs="*", metavar="data.key=value",
                          help="the --data file's own settings where they differ from the run's, e.g."
                               " data.prompt_field=question data.response_field=answer")
    evaluate.add_argument("--data", required=True, help="a file (or saved dataset folder) in any format training reads")
    evaluate.add_argument("--format", choices=FORMATS,
                          help="the data's format (default: the run's data.format, else prompt_response)")
    evaluate.add_argument("--json", action="store_true", help="print the figures as JSON")
    evaluate.add_argument("--compare-base", action="store_true",
                          help="also score the model the run started from (a full run: its config's model)")
    evaluate.add_argument("--batch-size", type=int, default=16,
                          help="rows per forward pass and prompts per generate call (default 16)")
    evaluate.add_argument("--max-new-tokens", type=int,
                          help=f"tokens per answer at most (default: the longest reference's + {ANSWER_SLACK})")
    evaluate.add_argument("--device", type=_device, default="auto", help=DEVICE_HELP)


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"'{text}' is not auto, cpu, cuda or cuda:N")


def version() -> str:
    """The installed package's version, else the one pyproject.toml beside the package says."""
    from importlib import metadata

    try:
        return metadata.version("slimtune")
    except metadata.PackageNotFoundError:
        return pyproject_version()


def pyproject_version() -> str:
    import tomllib

    path = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        return tomllib.loads(path.read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Positionals may come before, between or after flags (`train run.yaml --no-progress a.b=1`). Plain
    parsing takes positionals in one run, so a later one is refused; argparse can intermix them only
    on a parser without subcommands, so the command's own parser reads everything after its name."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = _parser()
    if not argv or argv[0] not in commands:  # no command, --help or an unknown one: the top level answers
        return parser.parse_args(argv)
    command = commands[argv[0]]
    args, extras = command.parse_known_intermixed_args(argv[1:])
    if extras:  # an unknown flag also leaves the positionals after it unread: name only the flag
        command.error(f"unrecognized arguments: {' '.join([a for a in extras if a.startswith('-')] or extras)}")
    args.command, args.words = argv[0], argv[1:]
    return args


def _train(args: argparse.Namespace) -> None:
    with interrupts.watching():  # Ctrl-C stops the run even when a finalizer swallows its first raise
        _train_or_demo(args)


def _train_or_demo(args: argparse.Namespace) -> None:
    from slimtune import train
    from slimtune.engines import settings

    if args.config is None and not args.overrides:
        given = [flag for flag, value in (("--nproc", args.nproc), ("--gpu", args.gpu)) if value is not None]
        if given:  # the demo would run in one process, without a word about the flag
            raise UserError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} a config or key=value"
                            " settings; `slimtune train` alone runs the built-in demo, in one process.")
        from slimtune import demo

        demo.main(progress=not args.no_progress)
        return
    path = args.config
    overrides = list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        overrides.insert(0, path)
        path = None
    if args.gpu:
        overrides.append(f"gpu={args.gpu}")
    _refuse_nonpositive(("--nproc", args.nproc))
    if args.nproc is not None and args.nproc > 1:
        from slimtune.dist import ranks as distributed

        if distributed.launched():
            raise UserError("--nproc starts torchrun itself; under torchrun leave it out (each rank is one process).")
    quiet = (lambda text: None) if args.nproc is not None and args.nproc > 1 else None  # rank 0 warns, not twice
    cfg = settings.load(path, overrides, warn=quiet)  # checked here, once, before any rank starts
    if args.nproc is not None and args.nproc > 1:
        from slimtune import launch

        launch.run_local(args.nproc, _without_nproc(args.words), cfg.output_dir)
        return
    _, summary = train.fit(cfg, progress=not args.no_progress)
    if summary["rank"] == 0:
        print(train.summary_table(summary))


def _without_nproc(words: list[str]) -> list[str]:
    """The train command's own words, less --nproc and its value (each rank is one process)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == "--nproc":
            skip = True
        elif not word.startswith("--nproc="):
            out.append(word)
    return out


def _plan(args: argparse.Namespace) -> None:
    from slimtune.planning import planner
    from slimtune.planning.weighing import Weighing
    from slimtune import presets

    _refuse_nonpositive(("--seq", args.seq), ("--batch", args.batch), ("--rank", args.rank))
    if args.max_seq is not None and args.max_seq < 0:
        raise UserError(f"--max-seq LIMIT must be a positive token count, got {args.max_seq}.")
    if args.max_seq and args.max_seq < args.seq:
        raise UserError(f"--max-seq {args.max_seq} is shorter than --seq {args.seq}, which every plan is weighed at;"
                        f" give a LIMIT of at least {args.seq}, or a shorter --seq.")
    _refuse_a_huge_step("--seq", args.seq, args.batch)
    if args.png:
        from slimtune.planning import picture as plan_picture

        plan_picture.check_target(args.png)  # before the plans' minutes, not after
    model_config = presets.model_config(args.model)
    if args.max_seq is not None:
        _refuse_a_huge_step("--max-seq LIMIT" if args.max_seq else "the model's positions (the --max-seq search's"
                            " end; give --max-seq a LIMIT)", planner.seq_limit_of(model_config, args.max_seq),
                            args.batch)
    machine = planner.Machine.named(args.gpu, args.host_ram, args.disk, cards=args.gpus, nodes=args.nodes)
    if args.rank is not None and args.method == "full":
        from slimtune.config_sources import say_warning

        say_warning("--rank is set but --method is full (every weight trains, no adapter): ignored.")
    base = planner.planning_config(args.method, 16 if args.rank is None else args.rank)
    longest = ", and the longest sequence each fits" if args.max_seq is not None else ""
    results = planner.plan(model_config, base, machine, args.batch, args.seq, max_seq=args.max_seq is not None,
                           seq_limit=args.max_seq or 0, progress=Weighing("slimtune plan", longest))
    title = f"slimtune plan: {args.model}, {args.method}, batch {args.batch} x seq {args.seq}, on {machine.describe()}"
    print(planner.to_json(results) if args.json else planner.table(results, title, machine, detail=args.detail))
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions and args.seq > positions and not args.json:
        print(f"note: --seq {args.seq} is longer than the model's {positions:,} positions (max_position_embeddings);"
              f" --seq {positions} plans rows of its own length.")
    if args.png:
        from slimtune.planning import picture as plan_picture

        written = plan_picture.write_png(results, machine, args.png, title)
        print(f"plan picture written to {written}", file=sys.stderr if args.json else sys.stdout)


# The most tokens a step the planner weighs: its synthetic batch is real memory (24 bytes a token), and a
# step of 2^24 tokens is past any card's activations already.
MAX_STEP_TOKENS = 1 << 24


def _refuse_a_huge_step(what: str, seq: int, batch: int) -> None:
    if seq * batch > MAX_STEP_TOKENS:
        raise UserError(f"{what} ({seq:,}) x --batch {batch:,} is {seq * batch:,} tokens a step; the planner weighs"
                        f" at most {MAX_STEP_TOKENS:,} (2^24).")


def _probe(args: argparse.Namespace) -> None:
    from slimtune.planning import probe

    profile = probe.run(args.out)
    for key, value in profile.items():
        print(f"  {key:<16} {value:,.2f}" if isinstance(value, float) else f"  {key:<16} {value}")
    if args.out:
        print(f"profile written to {args.out} (use it as --gpu {args.out})")


def _simulate(args: argparse.Namespace) -> None:
    from slimtune.engines.roundpipe import simulate

    simulate.run(args)


def _export(args: argparse.Namespace) -> None:
    from slimtune import export

    if args.out is not None and not args.merge:  # before "say what": --out alone says a merged folder is wanted
        raise UserError("--out names the merged folder; add --merge, or leave --out out with --gguf.")
    if not (args.merge or args.gguf):
        raise UserError("say what to export: --merge (an HF folder), --gguf FILE (a GGUF file), or both.")
    if args.merge and args.gguf:  # the GGUF's refusals before the merge writes anything
        export.check_gguf(args.run_dir, args.gguf)
    if args.merge:
        merged = export.merge_run(args.run_dir, args.out)
        step = f"step {merged.step}" if merged.step is not None else "the result"
        dtype = str(merged.dtype).removeprefix("torch.")
        print(f"merged model ({step}, adapter from {merged.source}) written to {merged.folder} in {dtype}, as the base")
    if args.gguf:
        written, trained = export.write_gguf(args.run_dir, args.gguf, args.gguf_type, progress=sys.stderr.isatty())
        step = f"step {trained.step}" if trained.step is not None else "the result"
        print(f"GGUF {args.gguf_type} ({step}, from {trained.source}) written to {written.path}: {written.tensors}"
              f" tensors, {written.bytes / 2**20:.1f} MiB")
        for note in written.notes:
            print(f"note: {note}")


def _chat(args: argparse.Namespace) -> None:
    from slimtune.serve import chat as conversation, inference

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be 0 (greedy) or a positive number, got {args.temperature}.")
    _refuse_nonpositive(("--max-new-tokens", args.max_new_tokens))
    for flag, text in (("--prompt", args.prompt), ("--system", args.system)):
        if text is not None:
            conversation.refuse_undecodable(text, flag)
    if args.prompt is None and sys.stdin is None:  # started with stdin closed (`<&-`): said before anything loads
        raise UserError("standard input is closed, so chat has no messages to read; give one with --prompt.")
    source = inference.resolve(args.run_dir)
    tokenizer = inference.load_tokenizer(source)
    style = conversation.settle_style(source, tokenizer, args.template, args.system)
    loaded = inference.load(source, args.device, tokenizer)
    print(f"slimtune chat: {loaded.describe()}", file=sys.stderr)
    talk = conversation.Conversation(loaded, style, args.max_new_tokens, args.temperature, args.system)
    if args.prompt is not None:
        talk.reply(args.prompt, sys.stdout)
        return
    conversation.interactive(talk, sys.stdout, sys.stderr)


def _eval(args: argparse.Namespace) -> None:
    from slimtune import progress
    from slimtune.serve import inference, evaluate as scoring

    _refuse_nonpositive(("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens))
    source = inference.resolve(args.run_dir)
    base = source.base_source() if args.compare_base else None  # a missing base is said before anything loads
    tokenizer = inference.load_tokenizer(source)
    shown = progress.mode_for(bar=True)  # a bar on a terminal, lines on a file or pipe (stderr)
    prepared = scoring.prepare(scoring.data_config(source, args.data, args.format, args.overrides), tokenizer,
                               args.batch_size, shown)
    new_tokens = args.max_new_tokens or (scoring.default_new_tokens(tokenizer, prepared.cases)
                                         if prepared.cases else None)
    scores = {}
    for name, src in (("model", source), ("base", base)):
        if src is not None:
            loaded = inference.load(src, args.device, tokenizer)
            print(f"slimtune eval [{name}]: {loaded.describe()}", file=sys.stderr)
            scores[name] = scoring.score(loaded, prepared, args.batch_size, new_tokens, shown)
            del loaded  # one model in memory at a time
    found = scoring.report(prepared, new_tokens, scores)
    print(scoring.to_json(found) if args.json else scoring.table(found, list(scores)))


def _refuse_nonpositive(*options: tuple[str, int | None]) -> None:
    for flag, value in options:
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be positive, got {value}.")


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
    except KeyboardInterrupt as err:  # Ctrl-C before a command began (the imports take seconds): nothing to say
        return _interrupted_early(argv, interrupts.exit_code(err))
    if argv is None and code in (130, 143):
        _deaf_while_ending()
    return code


def _deaf_while_ending() -> None:
    """The process's own command line, stopped and said so, ends now: a second Ctrl-C (or SIGTERM) in
    its teardown (atexit, finalizers) would print a KeyboardInterrupt traceback after the sentence and
    change nothing, so both are ignored from here. Not for in-process callers (they give argv)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _interrupted_early(argv: list[str] | None, code: int) -> int:
    """Exit 130 (143 for SIGTERM) without a word; the command line's own process ends at once (torch
    half imported need not be torn down), and stops the planning worker `plan` may have started."""
    from slimtune.planning import worker as planning_worker

    planning_worker.discard()
    if argv is None:
        _exit_without_teardown(code)
    return code


def _main(argv: list[str] | None) -> int:
    with interrupts.watching():  # the imports: Ctrl-C there may land in an extension's init, which drops it
        if argv is None and sys.argv[1:2] == ["plan"]:  # the command line itself, not a caller in-process
            from slimtune.planning import worker as planning_worker

            planning_worker.start(_option("--model"))  # it imports slimtune while this process parses and loads
        args = _parse(argv)
        importlib.import_module(COMMAND_MODULES[args.command])  # torch's seconds, under this watch
    try:
        code = _run(args)
    except Exception as err:  # a bug, or a collective that failed inside torch (FSDP's own)
        if not _in_a_failed_job():
            raise
        from slimtune.dist import ranks as distributed

        if distributed.lost_a_peer(err):  # inside torch's own collectives (FSDP's): not a bug
            print(f"slimtune: error: {_rank_prefix()}another rank {distributed.what_happened(err)} inside torch's"
                  " collectives; the run stops on every rank. The same command resumes from the last checkpoint.",
                  file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
        _exit_without_teardown(1)
    if argv is None and args.command == "plan":
        _exit_without_teardown(code)
    if code != 0 and _in_a_failed_job():
        _exit_without_teardown(code)
    return code


def _in_a_failed_job() -> bool:
    """A rank whose job failed: its process group may be broken, and tearing down the interpreter
    with gloo's threads still waiting on it aborts the process (SIGABRT) or hangs."""
    from slimtune.dist import ranks as distributed

    return distributed.joined()


def _option(flag: str) -> str | None:
    """`flag`'s value on the command line, read before argparse (which waits for heavy imports)."""
    argv = sys.argv[1:]
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word[len(flag) + 1:]
    return None


# The module each command runs from, imported before the command begins (in _main, under the watch of
# the imports): a Ctrl-C in those seconds ends the command line without a word, as one during parsing.
COMMAND_MODULES = {"train": "slimtune.train", "plan": "slimtune.planning.planner", "probe": "slimtune.planning.probe",
                   "simulate": "slimtune.engines.roundpipe.simulate", "export": "slimtune.export",
                   "chat": "slimtune.serve.chat", "eval": "slimtune.serve.evaluate"}


def _run(args: argparse.Namespace) -> int:
    try:
        commands = {"train": _train, "plan": _plan, "probe": _probe, "export": _export, "simulate": _simulate,
                    "chat": _chat, "eval": _eval}
        commands[args.command](args)
    except UserError as err:
        if not getattr(err, "said", False) and not _said_by_rank0(err):
            print(f"slimtune: error: {_rank_prefix(err)}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        if _says_its_stops():
            print(f"slimtune: {_interrupted(args.command, err)}", file=sys.stderr)
        return interrupts.exit_code(err)
    return 0


def _says_its_stops() -> bool:
    """Rank 0 alone under torchrun (a stop torchrun passes on reaches every rank), and no rank that
    `train --nproc` started: its launcher says it (launch.LAUNCHER_SAYS_STOPS)."""
    from slimtune import launch
    from slimtune.dist import ranks as distributed

    started_by_nproc = distributed.launched() and os.environ.get(launch.LAUNCHER_SAYS_STOPS)
    return distributed.env_rank() == 0 and not started_by_nproc


def _interrupted(command: str, err: KeyboardInterrupt) -> str:
    """What a Ctrl-C or SIGTERM leaves: a run's training says where the same command goes on from;
    before or after it, the checkpoints on disk are whole (each is written aside and renamed into place)."""
    words = interrupts.stopped_by(err)
    if isinstance(err, interrupts.Interrupted):
        return f"{words}. {err}"
    return f"{words}; the checkpoints already written are intact." if command == "train" else f"{words}."


def _said_by_rank0(err: UserError) -> bool:
    """Under torchrun rank 0 says what every rank would say alike (a config error, rank 0's own
    refusal handed on as distributed.Echo); the others end without repeating it."""
    from slimtune.dist import ranks as distributed

    if distributed.env_rank() == 0 or isinstance(err, distributed.JoinFailed):
        return False
    return isinstance(err, distributed.Echo) or not distributed.joined()  # before the job formed: a setting


def _rank_prefix(err: UserError | None = None) -> str:
    """The prefix "rank N: " on a rank other than 0, unless the sentence names its rank itself (a lost peer)."""
    from slimtune.dist import ranks as distributed

    if isinstance(err, distributed.PeerFailed):
        return ""
    return f"rank {distributed.env_rank()}: " if distributed.env_rank() else ""


def _exit_without_teardown(code: int) -> None:
    """End a finished `slimtune plan` at once: it has written its answer (and any cache file, by
    rename), and the interpreter's teardown after torch and transformers takes over a second."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
