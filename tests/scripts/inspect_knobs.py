"""Build the accelerator from train.py's flags, prepare a small model, dump what DDP really got.

usage: inspect_knobs.py OUT_JSON [train.py flags...]
"""
import json
import sys

from accel_ddp import exit_process
from accel_ddp.config import parse_args
from accel_ddp.loop import build_accelerator
from accel_ddp.models import build_model

out, argv = sys.argv[1], sys.argv[2:]
accelerator, _, _ = build_accelerator(parse_args(argv))
model = accelerator.prepare(build_model("mlp", num_classes=3, input_shape=(5,), hidden_size=8))
ddp = getattr(model, "_orig_mod", model)  # under --compile the DDP module sits inside the compiled wrapper
facts = ddp._get_ddp_logging_data()
if accelerator.is_main_process:
    with open(out, "w") as fh:
        json.dump({
            "wrapper": type(model).__name__,
            "ddp": type(ddp).__name__,
            "bucket_cap_bytes": ddp.bucket_bytes_cap,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph,
            "find_unused_parameters": ddp.find_unused_parameters,
            "comm_hook": facts.get("comm_hook"),
        }, fh)
accelerator.end_training()
exit_process(0)  # not sys.exit: see exit_process
