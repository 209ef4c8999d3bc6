"""A tensor-parallel rank > 0 whose speculator drafts are forced like rank 0's (tests/test_tensor_parallel.py).

Every rank runs its own speculator on the same plans, so a test that forces rank 0's drafts (`force_drafts`)
must force every rank's the same way, or their verify forwards would differ. The test points the rank
launcher's interpreter at a script running this file instead of `-m minidsa.parallel`;
`FORCED_DRAFTS_JSON` names the reference tokens. Requests whose ids the reference does not name (another
round's) keep their real drafts, on rank 0 as here.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ENV = "FORCED_DRAFTS_JSON"


def known_ids_only(reference: dict[str, list[int]], override):
    """`override` for the reference's requests, the proposed tokens unchanged for any other."""
    def apply(request_id, first_output, depth, toks):
        return override(request_id, first_output, depth, toks) if request_id in reference else list(toks)

    return apply


def main() -> None:
    from minidsa.speculative.mtp import MTPSpeculator
    from test_speculative import force_drafts, forced_override

    with open(os.environ[ENV]) as f:
        spec = json.load(f)
    reference = spec["reference"]
    init = MTPSpeculator.__init__

    def forcing_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        force_drafts(self, known_ids_only(reference, forced_override(reference, spec["topk"],
                                                                     random.Random(spec["seed"]))))

    MTPSpeculator.__init__ = forcing_init
    runpy.run_module("minidsa.parallel", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
