r"""CPU threads under load: decode speed with 1 and 2 intra-op threads, side by side in one process, while 0, 1 or 2
busy loops (`python3 -c "while True: pass"`) share the cores (docs/PERF.md, "2026-12-06, 2-core CPU: threads under
load").

One engine (SmolLM2-135M-Instruct with its shipped DFlash draft) is loaded once; each repetition generates --tokens
tokens of the guide's first prompt with 1 and with 2 threads (torch.set_num_threads, the order alternating between
repetitions), DFlash and plain, and prints one JSON line a generation (decode tok/s, and the thread count the
command's default would choose at that moment: flashdraft.args.free_threads). OpenMP's waiting is what the
environment says, so the two policies are two runs:

    OMP_WAIT_POLICY=PASSIVE python3 benchmarks/threads_under_load.py --loads 0,2,1 --reps 6   # flashdraft's default
    GOMP_SPINCOUNT=300000 python3 benchmarks/threads_under_load.py --loads 0,2,1 --reps 3     # libgomp's default
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "2")  # a pool of two, before torch loads

import torch  # noqa: E402

from flashdraft.args import free_threads  # noqa: E402
from flashdraft.bench.prompts import SEED_PROMPTS  # noqa: E402
from flashdraft.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from flashdraft.engine.sampling import SamplingParams  # noqa: E402
from flashdraft.formats.chat import render_prompt  # noqa: E402
from flashdraft.formats.named import NAMED_DRAFTS, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="0,2,1", help="busy loops beside the engine, one phase each")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args()
    policy = os.environ.get("OMP_WAIT_POLICY") or f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}"
    torch.set_num_interop_threads(1)
    engine = Engine.load(EngineConfig(str(resolve_model("smollm2-135m")), str(NAMED_DRAFTS["smollm2-135m"].path),
                                      device="cpu", ctx_size=1024))
    prompt = render_prompt(engine.tokenizer, SEED_PROMPTS[0], chat=True, system=None, reasoning="off")

    def run(threads: int, spec: bool) -> float:
        torch.set_num_threads(threads)
        done = engine.generate(Request(prompt_ids=prompt, speculative=spec,
                                       params=SamplingParams(max_tokens=args.tokens, ignore_eos=True)))
        return done.timings.to_dict()["predicted_per_second"]

    run(2, True), run(1, True)  # warm
    out = open(args.out, "a") if args.out else None
    table = defaultdict(list)
    for load in [int(x) for x in args.loads.split(",")]:
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
        try:
            time.sleep(1)
            for rep in range(args.reps):
                chosen = free_threads()
                for threads in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    for spec in (True, False):
                        tps = run(threads, spec)
                        table[(load, spec, threads)].append(tps)
                        line = json.dumps(dict(policy=policy, load=load, rep=rep, threads=threads, spec=spec,
                                               default_would_choose=chosen, tps=round(tps, 3),
                                               loadavg=round(os.getloadavg()[0], 2), time=time.strftime("%H:%M:%S")))
                        print(line, flush=True)
                        if out:
                            out.write(line + "\n")
                            out.flush()
        finally:
            for p in loops:
                p.kill()
                p.wait()
    print(f"\n{policy}: median decode tok/s (all runs)")
    for (load, spec, threads), values in sorted(table.items()):
        print(f"  {load} busy loop(s)  {'DFlash' if spec else 'plain '}  -t {threads}: "
              f"{statistics.median(values):6.2f}  {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main()
