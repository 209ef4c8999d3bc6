"""Command line: `minidsa generate | bench | bench-decode | serve | precompile`.

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
import os
import sys
import time
import traceback
from typing import Any

from minidsa.common.request import InvalidRequest
from minidsa.common.version import __version__
from minidsa.config import ENGINE_CHOICES, ConfigError, EngineConfig

# The engine flags are EngineConfig's fields; each field's --help text is its metadata (config.py), so the
# documentation of an argument lives in one place.

FLAG_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("--tp",)}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (exit code 2), not usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def engine_flag_help(f: dataclasses.Field) -> str | None:
    return f.metadata.get("help")


def engine_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields that are command-line flags."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (EngineConfig; the same names in LLM(...))")
    defaults = EngineConfig()
    for f in engine_fields():
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" ", "")
        described = engine_flag_help(f) or f.name.replace("_", " ")
        choices = f.metadata.get("choices") or ENGINE_CHOICES.get(f.name)
        if kind == "bool":
            if default:
                group.add_argument(_disable_flag(f.name), dest=f.name, action="store_false", help=described)
            else:
                group.add_argument(flag, dest=f.name, action="store_true", help=described)
        elif kind in ("bool|None", "Optional[bool]"):
            group.add_argument(flag, dest=f.name, type=_bool, default=None, metavar="{true,false}", help=described)
        elif kind in ("int", "float"):
            group.add_argument(flag, *FLAG_ALIASES.get(f.name, ()), dest=f.name, type=int if kind == "int" else float,
                               default=default,
                               metavar="N" if kind == "int" else "X", help=f"{described} (default: {default})")
        else:  # str, str | None
            group.add_argument(flag, dest=f.name, type=str, default=default, choices=choices,
                               metavar="{" + ",".join(choices) + "}" if choices else None,
                               help=described if default is None else f"{described} (default: {default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}
    return EngineConfig(**kwargs).validate()


def _checked(parse, ok, expected: str):
    """An argparse type: parse(text), accepted when ok(value); else an error naming what was expected."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value
    return check


_positive_int = _checked(int, lambda v: v >= 1, "expected a positive integer")
_port = _checked(int, lambda v: 0 <= v <= 65535, "port must be an integer in 0-65535 (0 = any free port)")
_non_negative_float = _checked(float, lambda v: v >= 0, "expected a number >= 0")
_request_rate = _checked(float, lambda v: v > 0, "expected requests per second > 0 or 'inf'")


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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = {"serve": "INFO", "generate": "WARNING", "bench": "WARNING", "bench-decode": "INFO",
                     "precompile": "INFO"}


def _add_common(parser: argparse.ArgumentParser, top: bool) -> None:
    # Accepted before and after the subcommand; the subcommand's copy must not reset the top-level one.
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="{" + ",".join(LOG_LEVELS) + "}",
                        default=None if top else argparse.SUPPRESS,
                        help="logging level; default INFO for serve, bench-decode and precompile, WARNING otherwise "
                             "(DEBUG also prints tracebacks of errors)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minidsa", description="DeepSeek Sparse Attention inference engine")
    parser.add_argument("--version", action="version", version=f"minidsa {__version__}")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_common(gen, top=False)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default 'Hello'")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the model's chat format")
    gen.add_argument("--max-tokens", type=int, default=32, metavar="N",
                     help="tokens to generate at most (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="X",
                     help="sampling temperature; 0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="X", help="nucleus sampling mass (default: 1 = off)")
    gen.add_argument("--top-k", type=int, default=0, metavar="N", help="sample among the N likeliest (default: 0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, metavar="X",
                     help="drop tokens below X times the likeliest one's probability (default: 0 = off)")
    gen.add_argument("--sampling-seed", type=int, default=None, metavar="N", help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt at a time)")
    add_engine_args(gen)

    bench = sub.add_parser("bench", help="benchmark on a synthetic workload (offline, or online against a server)",
                           description="Benchmark on a synthetic workload. Offline (default): every request is "
                                       "handed to an in-process engine at t = 0. Online (--request-rate, "
                                       "--max-concurrency or --base-url): requests arrive over the streaming "
                                       "OpenAI API of a server, minidsa's own (started in-process) or any other "
                                       "(--base-url). `minidsa bench-decode` runs the GPU decode suite.")
    _add_common(bench, top=False)
    bench.add_argument("--num-requests", type=_positive_int, default=None, metavar="N",
                       help="default 256 (16 on CPU)")
    bench.add_argument("--input-len", type=_length_range, default=None, metavar="N|MIN-MAX",
                       help="prompt lengths, uniform in [MIN, MAX]; default 100-1024 (100-512 on CPU)")
    bench.add_argument("--output-len", type=_length_range, default=None, metavar="N|MIN-MAX",
                       help="output lengths, uniform in [MIN, MAX]; default 100-1024 (32-128 on CPU)")
    bench.add_argument("--workload-seed", type=int, default=0, metavar="N",
                       help="seed of the synthetic workload (default 0)")
    bench.add_argument("--workload", choices=("random", "shared-prefix"), default="random",
                       help="random prompts, or one shared system prompt + short questions (--input-len is then "
                            "the question length; default 16-64), run with and without the prefix cache")
    bench.add_argument("--shared-prefix-len", type=_positive_int, default=None, metavar="N",
                       help="shared-prefix workload: system prompt length in tokens (default 2048)")
    online = bench.add_argument_group("online mode (any of these switches it on)")
    online.add_argument("--request-rate", type=_request_rate, default=None, metavar="R|inf",
                        help="Poisson arrivals at R requests/s; inf = all at t = 0 (default in online mode: inf)")
    online.add_argument("--max-concurrency", type=_positive_int, default=None, metavar="C",
                        help="at most C requests in flight (default: no limit)")
    online.add_argument("--base-url", default=None, metavar="URL",
                        help="an OpenAI-compatible server to drive (minidsa, vLLM, SGLang), e.g. "
                             "http://127.0.0.1:8000; default: start minidsa's server in-process")
    online.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name to send (default: the first of the server's /v1/models); "
                             "in-process, also the name the server serves")
    online.add_argument("--api-key", default=None, metavar="KEY", help="with --base-url: sent as a Bearer token")
    online.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                        help="service-level objectives a request must meet to count in goodput: ttft:MS, "
                             "tpot:MS (mean time per output token), e2el:MS")
    bench.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw throughput over time and latency percentiles")
    bench.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run")
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_engine_args(bench)

    from minidsa.bench import decode_suite

    suite = sub.add_parser("bench-decode", help="the GPU decode suite: step latency, MBU, graphs vs eager, DSA vs "
                           "dense, verify vs decode, transformers (writes JSON / markdown)",
                           description=decode_suite.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(suite, top=False)
    decode_suite.add_args(suite)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_common(serve, top=False)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port, 0 = any free one (default: 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name clients send and /v1/models lists (default: the preset's or the "
                            "checkpoint directory's name)")
    serve.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM / Ctrl-C, let in-flight requests finish for up to SECONDS, answering new "
                            "ones 503; then (or on a second signal) abort them (default: 30)")
    add_engine_args(serve)

    pre = sub.add_parser("precompile", help="start the engine once to fill the compile cache, then exit",
                         description="Start the engine with these engine arguments (weights, DeepGEMM's kernels, "
                                     "torch.compile, CUDA-graph capture, warm-up), so everything it compiles lands in "
                                     "the compile cache (--compile-cache-dir / $MINIDSA_CACHE_DIR); a later "
                                     "generate / bench / serve with the same model and arguments starts from it. "
                                     "Nothing is compiled on CPU.")
    _add_common(pre, top=False)
    add_engine_args(pre)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from minidsa.common.request import SamplingParams
    from minidsa.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos).validate()  # before the model loads
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    prompts: list[Any] = args.prompt or ["Hello"]
    if args.chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
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
    from minidsa.bench import offline as bench
    from minidsa.bench import online as bench_online

    online = args.request_rate is not None or args.max_concurrency is not None or args.base_url is not None
    goodput = bench_online.parse_goodput(args.goodput)
    if not online and (goodput or args.served_model_name or args.api_key):
        raise ConfigError("goodput" if goodput else "served_model_name" if args.served_model_name else "api_key",
                          "applies to online mode only (add --request-rate, --max-concurrency or --base-url)")
    config = engine_config_from_args(args)
    if online:
        result = bench_online.run_online_bench(
            config if args.base_url is None else None, base_url=args.base_url, num_requests=args.num_requests,
            input_len=args.input_len, output_len=args.output_len, seed=args.workload_seed,
            request_rate=args.request_rate if args.request_rate is not None else float("inf"),
            max_concurrency=args.max_concurrency, workload=args.workload, shared_prefix_len=args.shared_prefix_len,
            model_name=args.served_model_name, api_key=args.api_key, goodput=goodput, warmup=not args.no_warmup,
            progress=not args.no_progress)
        bench_online.print_online_summary(result)
    else:
        from minidsa.engine import Engine

        engine = Engine(config, progress=not args.no_progress)
        result = bench.run_bench(engine, args.num_requests, args.input_len, args.output_len, args.workload_seed,
                                 warmup=not args.no_warmup, progress=not args.no_progress, workload=args.workload,
                                 shared_prefix_len=args.shared_prefix_len)
        bench.print_summary(result)
    if args.json:
        bench.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            print(f"wrote {bench.plot_result(result, args.plot)}")
        except RuntimeError as e:  # matplotlib missing: the numbers above still stand
            print(f"minidsa bench: {e}", file=sys.stderr)
            return 1
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from minidsa.bench import decode_suite

    return decode_suite.run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from minidsa.server import app  # aiohttp: imported only for `serve`

    config = engine_config_from_args(args)
    sock = app.bind_socket(args.host, args.port)  # a taken port is an error now, not after loading the model
    try:
        app.serve(config, args.host, args.port, args.api_key, drain_timeout=args.shutdown_timeout,
                  served_model_name=args.served_model_name, sock=sock)
    except app.EngineDied as e:  # not bad input: exit 1, so a supervisor sees a failure, not a clean stop
        print(f"minidsa serve: error: the engine stopped: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_precompile(args: argparse.Namespace) -> int:
    from minidsa.config import compile_cache_root
    from minidsa.engine import Engine

    config = engine_config_from_args(args)
    start = time.perf_counter()
    engine = Engine(config, progress=True)
    try:
        summary = engine.runner.startup.summary(time.perf_counter() - start)
        cache = engine.runner.compile_cache
        where = cache.root if cache is not None else (
            "off" if compile_cache_root(config.compile_cache_dir) is None else f"not used on {engine.config.args.device}")
        print(f"minidsa precompile: {engine.model_name}: {summary}")
        print(f"compile cache: {where}")
    finally:
        engine.close()
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (arguments, files, ports), reported in one line with exit code 2."""
    from minidsa.models.loader import CheckpointError

    return ConfigError, InvalidRequest, CheckpointError, ValueError, OSError


def _teardown_stuck() -> bool:
    """A tensor-parallel teardown (a process-group abort) was left running: interpreter exit could wait on it."""
    launch = sys.modules.get("minidsa.parallel.launch")
    return launch is not None and launch.teardown_stuck()


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
    except BaseException:
        if not _teardown_stuck():
            raise
        traceback.print_exc()
        code = 1
    if _teardown_stuck():  # the process is ending anyway: end it without waiting on what was left behind
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    level = args.log_level or DEFAULT_LOG_LEVEL[args.command]
    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A benchmark of a big model starts for minutes: it says what it is doing, phase by phase (minidsa/exec/startup.py),
    # unless a log level was asked for.
    startup_level = logging.INFO if args.command == "bench" and args.log_level is None else logging.NOTSET
    logging.getLogger("minidsa.exec.startup").setLevel(startup_level)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "bench-decode": cmd_bench_decode, "serve": cmd_serve,
                "precompile": cmd_precompile}[args.command](args)
    except KeyboardInterrupt:
        print(f"minidsa {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        # bad input: one line naming it; the traceback only when asked for
        if level == "DEBUG":
            traceback.print_exc()
        print(f"minidsa {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
