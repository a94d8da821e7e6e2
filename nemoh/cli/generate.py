"""nemoh generate: load a checkpoint, stream generated text (or token ids), report the speed.

One prompt's text streams to stdout as it arrives; with several prompts the labelled pieces stream to
stderr and each complete result then goes to stdout. What was loaded and the timings go to stderr, so
`> out.txt` keeps only the text.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from nemoh.cli.info import summarise
from nemoh.cli.timing import GenerationClock
from nemoh.errors import RequestError
from nemoh.generate import generate
from nemoh.io.loader import load
from nemoh.text import encode_prompts, generate_text, load_tokenizer


class Printer:
    """Writes streamed pieces to `out`, after `lead` (e.g. the prompt) once the first piece arrives;
    with several prompts each run of pieces is labelled [i]."""

    def __init__(self, batch: int, out, lead: str = ""):
        self.batch, self.out, self.lead, self.current = batch, out, lead, None

    def piece(self, index: int, text: str) -> None:
        if self.batch > 1 and index != self.current:
            self.out.write(("\n" if self.current is not None else "") + f"[{index}] ")
        elif self.current is None:
            self.out.write(self.lead)
        self.current = index
        self.out.write(text)
        self.out.flush()

    def finish(self) -> None:
        self.out.write("\n")
        self.out.flush()


def parse_ids(prompts: list[str]) -> list[list[int]]:
    """["1 2 3", ...] -> [[1, 2, 3], ...] (RequestError naming the bad prompt)."""
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append([int(t) for t in p.split()])
        except ValueError:
            raise RequestError(f"--prompt-ids {p!r} (prompt {i}): must be space-separated integers") from None
    return out


def loaded_line(path: str, dtype: str, seconds: float) -> str:
    s = summarise(path)
    cfg = s.config
    device = jax.devices()[0]
    return (f"model {path}: {cfg.num_layers} layers {cfg.pattern}, {s.total.params / 1e6:.2f}M params, "
            f"dtype {dtype}, quantisation {s.quantisation}, device {device.platform} ({device.device_kind}) "
            f"x{jax.device_count()}; loaded in {seconds:.2f} s")


def run(args) -> int:
    out, err = sys.stdout, sys.stderr
    text_mode = args.prompt is not None
    if args.chat and not text_mode:
        raise RequestError("--chat needs text prompts (--prompt), not --prompt-ids")
    if text_mode:
        tokenizer = load_tokenizer(args.model)
        encode_prompts(tokenizer, args.prompt, args.chat)  # a bad prompt or template fails before the load
        prompts = args.prompt
    else:
        prompts = parse_ids(args.prompt_ids)

    t0 = time.perf_counter()
    params = load(args.model, dtype=jnp.dtype(args.dtype))
    print(loaded_line(args.model, args.dtype, time.perf_counter() - t0), file=err, flush=True)

    # What precedes each new text: the prompt itself (plain text), nothing (chat), or "ids -> ".
    heads = [("" if args.chat else p) if text_mode else " ".join(map(str, p)) + " -> " for p in prompts]
    single = len(prompts) == 1
    # One prompt streams to stdout after its head; a batch streams labelled pieces to stderr and then
    # writes each complete result to stdout.
    printer = Printer(1, out, heads[0]) if single else Printer(len(prompts), err)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    with GenerationClock() as clock:
        if text_mode:
            results = generate_text(params, tokenizer, prompts, chat=args.chat, on_text=printer.piece,
                                    on_token=clock.on_token, **options)
        else:
            def on_token(i: int, token: int) -> None:
                clock.on_token(i, token)
                printer.piece(i, f"{token} ")

            new_ids = generate(params, prompts, on_token=on_token, **options)
            results = ["".join(f"{t} " for t in new) for new in new_ids]
    printer.finish()
    if not single:
        for i, (head, result) in enumerate(zip(heads, results)):
            out.write(f"[{i}] {head}{result}\n")
    for line in clock.report(len(prompts)):
        print(line, file=err)
    return 0


def add_parser(sub, formatter) -> None:
    p = sub.add_parser("generate", help="generate text (or token ids) from a checkpoint, streamed",
                       description="Generate from a NemotronH checkpoint, streaming the new text to stdout as "
                                   "it arrives. Reports on stderr what was loaded, then the prefill and decode "
                                   "times with compilation counted apart.", formatter_class=formatter)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (Hugging Face layout)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a text prompt (needs the checkpoint's tokenizer.json); repeat for a batch "
                             "(default: none; give --prompt or --prompt-ids)")
    prompt.add_argument("--prompt-ids", action="append", metavar="IDS",
                        help='a prompt as space-separated token ids, e.g. "1 5 9"; repeat for a batch '
                             "(default: none; give --prompt or --prompt-ids)")
    p.add_argument("--chat", action="store_true",
                   help="send each --prompt as a user message through the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="new tokens per prompt, at most")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens (default: off)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="sample within the top probability mass P (default: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of the weights and activations")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.set_defaults(run=run)
