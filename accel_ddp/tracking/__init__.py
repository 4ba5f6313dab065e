"""Metrics while a run trains and reading a run back: the recorder, the trackers, the meters, the report.

    recorder.py   metrics.jsonl, summary.json, config.yaml and the trackers, from the main process
    console_log.py run.log: a tee of what the main process prints
    trackers.py   --report_to's trackers (Accelerate's and the csv one), guarded so a failing one never stops a run
    configured.py which installed trackers --report_to all starts: those configured to run on this machine
    tracker_builds.py   how each tracker is built: project, run name, folder (inside OUTPUT_DIR), resume state
    tracker_thread.py   the one thread that calls into the trackers, so that a slow start can be given up on
    folder_snapshot.py  what a failed tracker start created in the output folder, to remove exactly that
    csv_tracker.py      OUTPUT_DIR/metrics.csv through Accelerate's tracker API
    meters.py     throughput (samples/s, real tokens/s, FLOP/s, MFU), memory and the profiler
    flops.py      model FLOPs per sample or token, the peak table per device and precision
    step_log.py   StepLog: what each optimizer step leaves on the host (bar, timers, log lines)
    startup.py    how long each start-up phase took
    startup_block.py  what the run is about to do, said once before its first step (and the likely mistakes)
    curves.py     curves.png (losses, the task's metric, LR, throughput, epoch boundaries), from the run folder alone
    report.py     the `accel-ddp summary` table, and reading the run folder's JSON and YAML back

May import: util, config, lifecycle, outputs.
"""
