"""Read ``s3://BUCKET/PREFIX`` the way ``tensorboard --logdir s3://...`` does; print JSON.

Run as ``python tests/s3_read.py s3://BUCKET/PREFIX`` with ``S3_ENDPOINT`` and the credentials set:
TensorBoard registers its S3 filesystem (boto3) with the endpoint it finds at import, so a test
process that imported TensorBoard before setting them reads in a fresh process instead.
Output: ``{run: {"scalars": {tag: [[step, value], ...]}, "texts": {tag: [[step, text], ...]},
"run_json": {...} | null}}``, every point and text
in the order TensorBoard's server returns them, repeats kept. It reads with the multiplexer the
server reads with (``plugin_event_multiplexer``): the legacy ``event_multiplexer`` does not purge
text events on a restart's ``SessionLog.START``, so it would show a text the server hides.
"""

from __future__ import annotations

import json
import math
import sys

from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.compat.tensorflow_stub.io import gfile
from tensorboard.util import tensor_util


def read(url: str) -> dict[str, dict]:
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"tensors": 0})
    mux.AddRunsFromDirectory(url)
    mux.Reload()
    out: dict[str, dict] = {}
    for run in sorted(mux.Runs()):
        acc = mux.GetAccumulator(run)
        scalars: dict[str, list] = {}
        texts: dict[str, list] = {}
        for tag in acc.Tags()["tensors"]:
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
                scalars[tag] = [[e.step, _num(float(tensor_util.make_ndarray(e.tensor_proto)))] for e in acc.Tensors(tag)]
            else:
                shown = [[e.step, e.tensor_proto.string_val[0].decode("utf-8", "replace")] for e in acc.Tensors(tag)
                         if e.tensor_proto.string_val]
                if shown:
                    texts[tag] = shown
        path = f"{url}/{run}/run.json"
        run_json = json.loads(gfile.GFile(path, "r").read()) if gfile.exists(path) else None
        out[run] = {"scalars": scalars, "texts": texts, "run_json": run_json}
    return out


def _num(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)


if __name__ == "__main__":
    print(json.dumps(read(sys.argv[1])))
