"""A bundle proven in llama.cpp: its gguf/ served by llama.cpp's own llama-server, checked against
the engine's plain decoding and against our decoder (`stage=eval eval.bundle=<b> eval.engine=llama.cpp`).

Two servers on 127.0.0.1 (free ports, always stopped): the bundle's target alone, and the
target with the bundle's draft (`--spec-type`, `--spec-draft-n-max` = the bundle's k). Every
turn of the eval conversations goes to both as our chat template's token ids (the next turn
continues from llama.cpp's plain answer), greedy, eval.max_new_tokens, the two servers taking
turns for eval.engine_repeats repetitions. Per prompt set it reports:

- prompts whose tokens differ with the draft from llama.cpp's own plain output (the first
  divergence of each): speculative decoding in the engine must change nothing;
- τ in the engine: generated tokens per target pass, n / (n - draft_n_accepted), and the
  acceptance draft_n_accepted / draft_n, from llama.cpp's own `timings`;
- tokens/s with and without the draft (medians over the repetitions of the engine's generation
  timings) and the speedup;
- our replay: the acceptance our model of llama.cpp's chain drafting predicts over the engine's
  answers (k greedy draft tokens a pass after the target's token, never past max_new_tokens;
  a draft model over its full vocabulary, an EAGLE-3 head over the target's features of every
  token known, then its own): equal counts mean the engine runs the draft we trained;
- answers of llama.cpp's plain target that differ from ours (its target GGUF is quantized or
  f16 against our fp32): counted and said, not an error;
- where answers differ with the draft, a control: those turns again on two fresh servers that
  compute one token per micro-batch (`-ub 1`), so that verifying a draft runs the same kernels
  as decoding one token. llama.cpp's CPU kernels give a batch of tokens slightly different
  numbers than one token alone (llama.cpp#25618), and a near-tie can flip; answers equal under
  the control mean the engine's drafting itself is lossless.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from pipeline import llama_cpp
from pipeline.data.chat import first_prompt_ids, next_turn_ids
from pipeline.errors import PipelineError
from pipeline.eval.measure import first_divergence
from pipeline.export.gguf import SPEC_FLAGS

log = logging.getLogger(__name__)


@dataclass
class Turn:
    context: list[int]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    """Per server (plain, draft): the tokens of its first repetition."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0


def complete(server: llama_cpp.Server, ids: list[int], max_new_tokens: int) -> dict:
    import httpx

    body = dict(prompt=ids, n_predict=max_new_tokens, temperature=0.0, top_k=1, cache_prompt=False,
                return_tokens=True, stream=False)
    try:
        answer = httpx.post(f"http://127.0.0.1:{server.port}/completion", json=body, timeout=600).json()
    except (httpx.HTTPError, ValueError) as e:
        tail = llama_cpp.last_line(server.read_log()) if not server.alive() else str(e)
        raise PipelineError(f"llama-server stopped answering: {tail}") from None
    if "error" in answer or "tokens" not in answer:
        raise PipelineError(f"llama-server refused a prompt: {str(answer.get('error', answer))[:300]}")
    return answer


def passes(answer: list[int], k: int, max_new_tokens: int, propose) -> tuple[int, int]:
    """(drafted, accepted) of llama-server's chain drafting over `answer`, the target's tokens:
    its first token comes from the prompt's pass, then each pass drafts
    min(k, max_new_tokens - 1 - p) tokens after the p known, `propose(p, n)`, and keeps the
    matching ones and the target's own next token."""
    drafted = accepted = 0
    p = 1
    while p < len(answer):
        n = min(k, max_new_tokens - p - 1)
        if n <= 0:
            break
        proposal = propose(p, n)
        a = 0
        while a < len(proposal) and p + a < len(answer) and proposal[a] == answer[p + a]:
            a += 1
        drafted, accepted = drafted + len(proposal), accepted + a
        p += a + 1
    return drafted, accepted


@torch.no_grad()
def replay_chain(draft: torch.nn.Module, context: list[int], answer: list[int], k: int,
                 max_new_tokens: int) -> tuple[int, int]:
    """A draft model's (drafted, accepted) over `answer`: greedy over its full vocabulary, as
    llama.cpp runs the converted model."""
    from transformers import DynamicCache

    from pipeline.decode.static_kv import with_cache

    device = next(draft.parameters()).device

    def propose(p: int, n: int) -> list[int]:
        cache = with_cache(draft, DynamicCache(config=draft.config))
        ids = torch.tensor([context + answer[:p]], device=device)
        proposal: list[int] = []
        while len(proposal) < n:
            proposal.append(int(draft(ids, use_cache=True, logits_to_keep=1, **cache).logits[0, -1].argmax()))
            ids = ids.new_tensor([proposal[-1:]])
        return proposal

    return passes(answer, k, max_new_tokens, propose)


@torch.no_grad()
def replay_eagle(head: torch.nn.Module, target: torch.nn.Module, context: list[int], answer: list[int], k: int,
                 max_new_tokens: int) -> tuple[int, int]:
    """An EAGLE-3 head's (drafted, accepted) over `answer`, as llama.cpp's draft-eagle3 drafts:
    head position t reads token t+1 and the target's three layer inputs at t (fused by fc) for
    every token the target has seen, then feeds back its own pre-norm output; its draft
    vocabulary maps to the target's (d2t)."""
    from transformers import DynamicCache

    device = next(head.parameters()).device
    seq = torch.tensor([context + answer], device=device)
    out = target(seq, output_hidden_states=True, logits_to_keep=1)
    fused = head.fuse(torch.cat([out.hidden_states[i] for i in head.feature_layers], dim=-1))

    def propose(p: int, n: int) -> list[int]:
        m = len(context) + p  # tokens known; the target has seen the first m - 1
        cache = DynamicCache(config=head.config)
        step = head(seq[:, 1:m], fused[:, : m - 1], cache=cache, use_cache=True, logits_to_keep=1)
        proposal: list[int] = []
        while True:
            proposal.append(int(head.draft_to_target[step.logits[0, -1].argmax()]))
            if len(proposal) == n:
                return proposal
            step = head(seq.new_tensor([proposal[-1:]]), step.hidden[:, -1:], cache=cache, use_cache=True)

    return passes(answer, k, max_new_tokens, propose)


def check_llama_cpp(bundle, target, convs, max_turns: Optional[int], max_new_tokens: int, eos_ids: set[int],
                    repeats: int, ours: Optional[dict] = None) -> dict:
    """Serve `bundle`'s gguf/ in llama-server and measure it (see the module doc); `ours`: our
    decoder's measurement of the same bundle on the same prompts: its tau, and our plain
    decoding's answer by context (tuple of ids)."""
    engine = bundle.meta.get("llama_cpp") or {}
    if not engine.get("command"):
        why = engine.get("skipped") or "it was exported before bundles held gguf/: export it again"
        raise PipelineError(f"{bundle.path} has no gguf/ for llama.cpp: {why}")
    folder = Path(bundle.path)
    k = int(engine["num_draft_tokens"])
    tok = target.tokenizer
    longest = max(len(first_prompt_ids(tok, c)) for c in convs)
    ctx = str(max(4096, 2 * (longest + max_new_tokens * (max_turns or 4)) + 512))
    threads = ["-t", str(torch.get_num_threads()), "-c", ctx, "-np", "1", "--no-warmup"]
    spec = spec_flags(folder, engine)
    turns: list[Turn] = []
    total = sum(min(len(c.user_turns), max_turns or len(c.user_turns)) for c in convs)
    with llama_cpp.Server(folder / engine["target"], threads) as plain, \
            llama_cpp.Server(folder / engine["target"], threads + spec) as drafted, \
            tqdm(total=total, desc="llama.cpp", unit="turn", dynamic_ncols=True) as bar:
        servers = {"plain": plain, "draft": drafted}
        for conv in convs:
            answers: list[str] = []
            context: Optional[list[int]] = None
            for t in range(min(len(conv.user_turns), max_turns or len(conv.user_turns))):
                if t == 0:
                    context = first_prompt_ids(tok, conv)
                else:
                    prev = turns[-1]
                    out = prev.tokens["plain"]
                    last = out[-1] if out else prev.context[-1]
                    context = prev.context + out + next_turn_ids(tok, conv, t, answers, last, eos_ids)
                turn = Turn(context, seconds={"plain": [], "draft": []})
                for r in range(repeats):
                    for name in (("plain", "draft") if r % 2 == 0 else ("draft", "plain")):
                        answer = complete(servers[name], context, max_new_tokens)
                        timings = answer.get("timings", {})
                        turn.seconds[name].append(timings.get("predicted_ms", 0.0) / 1000)
                        if r == 0:
                            turn.tokens[name] = [int(i) for i in answer["tokens"]]
                            if name == "draft":
                                turn.drafted = int(timings.get("draft_n", 0))
                                turn.accepted = int(timings.get("draft_n_accepted", 0))
                answers.append(tok.decode(turn.tokens["plain"], skip_special_tokens=True))
                turns.append(turn)
                bar.update(1)
    result = summarize(turns, bundle, target.model, k, max_new_tokens, ours, eos_ids)
    differ = [t for t in turns if t.tokens["plain"] != t.tokens["draft"]]
    if differ:
        result["control"] = control(folder / engine["target"], threads, spec, differ, max_new_tokens)
    return result


CONTROL_FLAGS = ("-ub", "1")


def spec_flags(folder: Path, engine: dict) -> list[str]:
    """llama-server's flags that add the bundle's draft (bundle.json's llama_cpp entry)."""
    return ["-md", str(folder / engine["draft"]), "--spec-type", engine["spec_type"], "--spec-draft-n-max",
            str(engine["num_draft_tokens"]), *SPEC_FLAGS]


def control(target_gguf: Path, args: list[str], spec: list[str], turns: list[Turn], max_new_tokens: int) -> dict:
    """`turns` again, plain and with the draft, every micro-batch one token (CONTROL_FLAGS on
    both servers): how many answers still differ."""
    flags = [*args, *CONTROL_FLAGS]
    with llama_cpp.Server(target_gguf, flags) as plain, llama_cpp.Server(target_gguf, flags + spec) as drafted:
        differ = sum(complete(plain, t.context, max_new_tokens)["tokens"]
                     != complete(drafted, t.context, max_new_tokens)["tokens"]
                     for t in tqdm(turns, desc="llama.cpp -ub 1", unit="turn", dynamic_ncols=True))
    return dict(flags=" ".join(CONTROL_FLAGS), turns=len(turns), outputs_differ=differ)


def summarize(turns: list[Turn], bundle, target: torch.nn.Module, k: int, max_new_tokens: int, ours: Optional[dict],
              eos: set[int]) -> dict:
    generated = sum(len(t.tokens["draft"]) for t in turns)
    drafted, accepted = sum(t.drafted for t in turns), sum(t.accepted for t in turns)
    differ = [dict(turn=i, first_divergence=first_divergence(t.tokens["plain"], t.tokens["draft"]))
              for i, t in enumerate(turns) if t.tokens["plain"] != t.tokens["draft"]]
    tokens_plain = sum(len(t.tokens["plain"]) for t in turns)
    rate = lambda name, tokens: tokens / statistics.median(
        [sum(t.seconds[name][r] for t in turns) for r in range(len(turns[0].seconds[name]))])
    plain_tps, draft_tps = rate("plain", tokens_plain), rate("draft", generated)
    result = dict(
        engine="llama.cpp", spec_type=bundle.meta["llama_cpp"]["spec_type"], num_draft_tokens=k,
        command=bundle.meta["llama_cpp"]["command"], turns=len(turns), tokens=generated,
        outputs_differ=len(differ), divergences=differ[:20],
        draft_n=drafted, draft_n_accepted=accepted,
        acceptance=accepted / drafted if drafted else None,
        tau=generated / (generated - accepted) if generated > accepted else None,
        plain_tokens_per_s=plain_tps, draft_tokens_per_s=draft_tps, speedup=draft_tps / plain_tps,
    )
    replay = {"draft_model": lambda t: replay_chain(bundle.draft, t.context, t.tokens["plain"], k, max_new_tokens),
              "eagle": lambda t: replay_eagle(bundle.draft, target, t.context, t.tokens["plain"], k, max_new_tokens)}
    if bundle.method in replay:
        replayed = [replay[bundle.method](t) for t in tqdm(turns, desc="replay", unit="turn", dynamic_ncols=True)]
        result["replay"] = dict(drafted=sum(d for d, _ in replayed), accepted=sum(a for _, a in replayed))
    if ours is not None:
        result["ours_tau"] = ours.get("tau")
        mine = ours.get("plain", {})  # our plain decoding's answer by context
        same = [(t.tokens["plain"], mine[tuple(t.context)]) for t in turns if tuple(t.context) in mine]
        result["target_compared"] = len(same)
        result["target_answers_differ_from_ours"] = sum(theirs != without_end(answer, eos) for theirs, answer in same)
    return result


def without_end(answer: list[int], eos: set[int]) -> list[int]:
    """Ours keeps the end-of-turn token it stopped at; llama.cpp's answer leaves it out."""
    return list(answer[:-1]) if answer and answer[-1] in eos else list(answer)


def table(result: dict) -> str:
    """The engine check as console lines."""
    ours = f"{result['ours_tau']:.2f}" if result.get("ours_tau") else "–"
    tau = f"{result['tau']:.2f}" if result.get("tau") else "–"
    lines = [f"llama.cpp ({result['spec_type']}, k={result['num_draft_tokens']}), {result['turns']} turns:",
             f"  {'':<24} {'tau':>6} {'tok/s':>8} {'vs plain':>9}",
             f"  {'llama-server plain':<24} {'1.00':>6} {result['plain_tokens_per_s']:>8.2f} {'1.00x':>9}",
             f"  {'llama-server + draft':<24} {tau:>6} {result['draft_tokens_per_s']:>8.2f} {result['speedup']:>8.2f}x",
             f"  our decoder's tau for the same draft and k: {ours}",
             f"  outputs with the draft that differ from llama.cpp's plain: {result['outputs_differ']} of {result['turns']}"
             + (f"; of those, {c['outputs_differ']} of {c['turns']} still differ when every micro-batch is one token "
                f"({c['flags']}: the same kernels verify a draft as decode one token)"
                if (c := result.get("control")) else ""),
             f"  drafts accepted: {result['draft_n_accepted']} of {result['draft_n']} (llama.cpp)"
             + (f", {result['replay']['accepted']} of {result['replay']['drafted']} (our replay of its answers)"
                if "replay" in result else "")]
    if result.get("target_compared"):
        lines.append(f"  llama.cpp's plain answers that differ from our plain decoding of the same prompt (its "
                     f"target GGUF against our weights): {result['target_answers_differ_from_ours']} of "
                     f"{result['target_compared']}")
    return "\n".join(lines)
