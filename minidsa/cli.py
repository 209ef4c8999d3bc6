"""Command line: `minidsa generate | bench | serve`.

Engine arguments are derived from EngineConfig's fields: `max_total_tokens`
is `--max-total-tokens`; booleans that default to True are turned off with
`--disable-...` (`enable_cuda_graph` -> `--disable-cuda-graph`,
`use_deep_gemm` -> `--disable-deep-gemm`), those defaulting to False are
turned on by their name (`--trust-remote-code`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from minidsa.config import QUANTIZATIONS, ConfigError, EngineConfig
from minidsa.request import InvalidRequest

_SKIP_FIELDS = {"extra"}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _disable_flag(name: str) -> str:
    for prefix in ("enable_", "use_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return "--disable-" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (EngineConfig)")
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP_FIELDS:
            continue
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" ", "")
        if kind == "bool":
            if default:
                group.add_argument(_disable_flag(f.name), dest=f.name, action="store_false",
                                   help=f"turn off {f.name}")
            else:
                group.add_argument(flag, dest=f.name, action="store_true", help=f"turn on {f.name}")
        elif kind in ("bool|None", "Optional[bool]"):
            group.add_argument(flag, dest=f.name, type=_bool, default=None, metavar="{true,false}",
                               help="default: decided by the model")
        elif kind == "int":
            group.add_argument(flag, dest=f.name, type=int, default=default, help=f"default: {default}")
        elif kind == "float":
            group.add_argument(flag, dest=f.name, type=float, default=default, help=f"default: {default}")
        else:  # str, str | None
            help_text = ("preset name (tiny, bench-dsv32, bench-glm5; NAME:LAYERS sets the layer count, e.g. "
                         "bench-dsv32:8) or checkpoint directory; default: tiny") \
                if f.name == "model" else f"default: {default}"
            choices = QUANTIZATIONS if f.name == "quantization" else None
            if choices:
                help_text = ("weights: auto = as the checkpoint stores them (e4m3 + block scales stay FP8), fp8 = "
                             "quantise bf16 projections to FP8 at load, none = dequantise to --dtype; default: auto")
            group.add_argument(flag, dest=f.name, type=str, default=default, choices=choices, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name not in _SKIP_FIELDS and hasattr(args, f.name)}
    return EngineConfig(**kwargs).validate()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _length_range(text: str) -> tuple[int, int]:
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
        else:
            lo = hi = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minidsa", description="DeepSeek Sparse Attention inference engine")
    parser.add_argument("--log-level", default="WARNING", help="python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default 'Hello'")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt at a time)")
    add_engine_args(gen)

    bench = sub.add_parser("bench", help="offline throughput benchmark on a synthetic workload",
                           description="Offline throughput on a synthetic workload. "
                                       "`minidsa bench --suite decode [--help]` runs the GPU decode suite instead.")
    bench.add_argument("--num-requests", type=int, default=None, help="default 256 (16 on CPU)")
    bench.add_argument("--input-len", type=_length_range, default=None, metavar="N|MIN-MAX",
                       help="prompt lengths, uniform in [MIN, MAX]; default 100-1024 (100-512 on CPU)")
    bench.add_argument("--output-len", type=_length_range, default=None, metavar="N|MIN-MAX",
                       help="output lengths, uniform in [MIN, MAX]; default 100-1024 (32-128 on CPU)")
    bench.add_argument("--workload-seed", type=int, default=0, help="seed of the synthetic workload (default 0)")
    bench.add_argument("--workload", choices=("random", "shared-prefix"), default="random",
                       help="random prompts, or one shared system prompt + short questions (--input-len is then "
                            "the question length; default 16-64); compare with --disable-prefix-caching")
    bench.add_argument("--shared-prefix-len", type=_positive_int, default=None, metavar="N",
                       help="shared-prefix workload: system prompt length in tokens (default 2048)")
    bench.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw throughput over time and latency percentiles")
    bench.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run")
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_engine_args(bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    add_engine_args(serve)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from minidsa.engine import LLM
    from minidsa.request import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    prompts: list[Any] = args.prompt or ["Hello"]
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    if args.stream:
        for p in prompts:
            for out in llm.stream(p, params):
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            sys.stdout.write(f"\n[{out.finish_reason}, {len(out.token_ids)} tokens]\n")
        return 0
    for p, out in zip(args.prompt or ["Hello"], llm.generate(prompts, params)):
        print(f"prompt: {p!r}")
        print(f"output: {out.text!r}")
        print(f"        [{out.finish_reason}, {len(out.token_ids)} tokens]")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from minidsa.bench import plot_result, print_summary, run_bench, write_json
    from minidsa.engine import Engine

    engine = Engine(engine_config_from_args(args), progress=not args.no_progress)
    result = run_bench(engine, args.num_requests, args.input_len, args.output_len, args.workload_seed,
                       warmup=not args.no_warmup, progress=not args.no_progress, workload=args.workload,
                       shared_prefix_len=args.shared_prefix_len)
    print_summary(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            print(f"wrote {plot_result(result, args.plot)}")
        except RuntimeError as e:  # matplotlib missing: the numbers above still stand
            print(f"minidsa bench: {e}", file=sys.stderr)
            return 1
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from minidsa.server import app  # aiohttp: imported only for `serve`

    config = engine_config_from_args(args)
    if hasattr(app, "main"):
        return app.main(args) or 0
    app.serve(config, args.host, args.port, args.api_key)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:3] == ["bench", "--suite", "decode"]:  # the GPU decode suite has its own flags (minidsa/perf.py)
        from minidsa import perf

        return perf.main(argv[3:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve}[args.command](args)
    except (ConfigError, InvalidRequest, ValueError) as e:  # bad arguments / workloads: a message, not a traceback
        print(f"minidsa {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
