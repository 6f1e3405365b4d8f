"""Issue 23 probe: does starting verify's exact background prefill at once (``background_start="immediate"``)
bring its first verified token closer to ``prefix``'s TTFT on the 2-core CPU? (README, "Targets (issue 23)":
on CPU the default ``"auto"`` starts it after the first draft, and the first verified token comes at 2.2x
``prefix``'s TTFT.)

Registers two experimental modes, ``auto-verify-immediate`` (``rebase="verify"``,
``background_start="immediate"``) and ``auto-verify-k4`` (the same with ``max_optimistic_tokens=4``), beside the
library's named modes for this process only, then runs ``hf-kvreuse bench`` with the arguments given, e.g.

    python research/optimistic/verify_start_probe.py --model qwen2.5-0.5b --dtype fp32 --methods full,prefix,auto-verify,\\
        auto-verify-immediate --n 3 --max-new-tokens 16 --threads 2 --out /work/runs/verify_start
    python scripts/bench_table.py /work/runs/verify_start/bench.json
"""

import sys

from hf_kvreuse import session
from hf_kvreuse.cli import main

session.MODES["auto-verify-immediate"] = dict(policy="auto", rebase="verify",
                                              method_kwargs=dict(background_start="immediate"))
# fewer drafts: the foreground stops drafting after 4 tokens and the background prefill has the core to itself
session.MODES["auto-verify-k4"] = dict(policy="auto", rebase="verify",
                                       method_kwargs=dict(background_start="immediate", max_optimistic_tokens=4))

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
