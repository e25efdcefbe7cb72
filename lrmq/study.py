"""`python -m lrmq.study --config configs/study/NAME.yaml [key=value ...]`: both papers' comparisons as one
matrix of arms (training and/or quantization recipes) over seeds, every arm evaluated the same way.

Arms run as separate processes (`lrmq.train`, `lrmq.quantize`, `lrmq.studies.heldout` or `lrmq.evaluate`),
up to `parallel` at once, into one study directory; a rerun skips what is done (a killed study resumes).
Outputs: results.json, results.md (mean ± std over seeds, memory of each model) and plots/. `--list` prints
the arms without running them; `--report` rewrites the results from the finished jobs. docs/study.md.
"""

from __future__ import annotations

import sys

from lrmq import cli, configlib
from lrmq.studies.config import StudyConfig, load_study_config
from lrmq.studies.matrix import arm_format, expand
from lrmq.studies.report import write_report
from lrmq.studies.runner import Study


def parse_args(argv=None):
    ap = cli.ArgumentParser("study", description=__doc__.splitlines()[0])
    configlib.add_config_args(ap, StudyConfig, required=True)  # --config, overrides, --help-config, --print-config
    ap.add_argument("--list", action="store_true", help="print the arms (and jobs) and exit")
    ap.add_argument("--report", action="store_true", help="only rewrite results.json / results.md / plots")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def _main(args) -> int:
    cfg = load_study_config(args.config, args.overrides)
    if args.print_config:
        print(configlib.dump_config(cfg, comments=True), end="")
        return 0
    if args.list:
        arms = expand(cfg)
        for a in arms:
            what = {"base": "evaluate the starting checkpoint", "train": "lrmq.train " + " ".join(a.train),
                    "ptq": f"lrmq.quantize {a.method} w{a.bits} g{a.group_size} of {a.source}"
                           + (f" ({' '.join(a.quantize)})" if a.quantize else "")
                           + (" before=pseudo_ft" if a.before == "pseudo_ft" else "")}[a.kind]
            fmt = arm_format(cfg, a)
            print(f"{a.name:32s} {a.group:22s} {fmt.describe() if fmt else 'float':42s} {what}")
        pairs = [(a, label, b) for a in arms for label, b in a.compare.items()]
        if pairs:
            print("\nQAT vs PTQ pairs (results.md's QAT-vs-PTQ table):")
            by = {a.name: a for a in arms}
            for a, label, b in pairs:
                fa, fb = arm_format(cfg, a), arm_format(cfg, by[b])
                same = "same format" if fa and fb and fa.same_format(fb) else "DIFFERENT formats"
                print(f"  {label:16s} {a.name:24s} {fa.describe() if fa else 'float':42s} vs {b:26s} "
                      f"{fb.describe() if fb else 'float'}  [{same}]")
        print(f"{len(arms)} arms x {len(cfg.seeds)} seeds = {len(arms) * len(cfg.seeds)} jobs", file=sys.stderr)
        return 0
    study = Study(cfg)
    failed: list = []
    if not args.report:
        summary = study.run(progress=not args.no_progress)
        failed = summary["failed"]
        print(f"[lrmq.study] {summary['jobs']} jobs: {summary['ran']} ran, {summary['already_done']} were done, "
              f"{len(failed)} without a result", file=sys.stderr)
    else:
        study.plan()
    res = write_report(study, failed)
    print(f"[lrmq.study] wrote {study.out}/results.md, results.json"
          + (f" and {len(res['plots'])} plots" if res["plots"] else ""), file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    cli.select_platforms()  # before JAX starts a backend (lrmq.cli)
    args = parse_args(argv)
    return cli.run_main("study", lambda: _main(args))


if __name__ == "__main__":
    cli.tune_gc()
    sys.exit(main())
