"""Summarise the char LM cells of outer_sweep beside the stamped seed-0 sweep (the 2026-12-07 char LM section of
docs/research/2026-11-async.md): python THIS benchmarks/results/outer_sweep_char_lm.json benchmarks/results/outer_sweep.json"""
import json, sys
DEFAULT, LOOK = "0.375/0.5/on", "0.375/0.5/on/look[0.1,1]"
clm = json.load(open(sys.argv[1]))["results"]
old = [r for r in json.load(open(sys.argv[2]))["results"] if r["ddp"] is not None]
fixed = [k for k in clm[0]["runs"] if "/look" not in k and "/agree" not in k]
def best(r):
    lab = min(fixed, key=lambda k: r["runs"][k]["final"]); return lab, r["runs"][lab]["final"]
mode = lambda r: "DiLoCo" if r["cell"][3] == "sync" else "async"
print("| W | mode | H | best fixed | best ÷ DDP | default ÷ best | lookahead ÷ best | DDP | best loss | unstable fixed |")
for r in clm:
    w, m, h = r["cell"][2], mode(r), r["cell"][4]; lab, b = best(r)
    bad = [k for k in r["runs"] if not r["runs"][k]["stable"]]
    print(f"| {w} | {m} | {h} | `{lab}` | {b / r['ddp']:.3f} | {r['runs'][DEFAULT]['final'] / b:.3f} | "
          f"{r['runs'][LOOK]['final'] / b:.3f} | {r['ddp']:.4f} | {b:.4f} | {bad} |")
for md in ("async", "DiLoCo"):
    mine = [r for r in clm if mode(r) == md]; theirs = [r for r in old if mode(r) == md]
    rows = []
    for k in fixed:
        wc = max(r["runs"][k]["final"] / best(r)[1] for r in mine) if mine else float("nan")
        wo = max(r["runs"][k]["final"] / best(r)[1] for r in theirs)
        ok = all(r["runs"][k]["stable"] for r in mine + theirs)
        rows.append((max(wc, wo), wc, wo, k, ok))
    rows.sort()
    print(f"\n{md}: char LM cells {len(mine)}, stamped cells {len(theirs)}")
    print("| setting | worst ÷ best, char LM | worst, stamped seed 0 | worst, both | stable |")
    for both, wc, wo, k, ok in rows:
        print(f"| `{k}` | {wc:.3f} | {wo:.3f} | {both:.3f} | {ok} |")
    if mine:
        print("lookahead worst char LM", max(r["runs"][LOOK]["final"] / best(r)[1] for r in mine))
