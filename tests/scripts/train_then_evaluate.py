"""A user's script: train, then evaluate, predict and evaluate again in the same processes (four process groups
formed one after the other under one launch). Prints each figure and the prediction count as one JSON line."""
import json
import sys

from accel_ddp import TrainConfig, evaluate, exit_process, predict, train

out = sys.argv[1]
summary = train(TrainConfig(dataset="digits", max_steps=6, hidden_size=32, output_dir=out))
first = evaluate(out)
rows = predict(out, f"{out}/predictions.jsonl")
again = evaluate(out)
if first["eval_samples"]:  # every rank prints its line; the test compares them
    # One write of the whole line: print() writes the text and its newline apart when stdout is unbuffered (as under
    # the launcher), and the two ranks' lines then interleave on the shared pipe ('{...}{...}' seen once in CI).
    sys.stdout.write(json.dumps({"summary": summary["eval_loss"], "first": first["eval_loss"],
                                 "again": again["eval_loss"], "rows": rows}) + "\n")
    sys.stdout.flush()
exit_process(0)
