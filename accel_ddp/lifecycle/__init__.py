"""How a run ends: preemption signals, non-finite losses, failure reports (one per launch), exit codes.

    exit_codes.py   ExitCode, every exit code in one list; each rank's code, left for `accel-ddp launch` (a signalled
                    launcher loses them)
    failure.py      the first failing rank reports, the others stay quiet; exit codes; main_process_decides
    hang.py         --hang_timeout: a rank without an optimizer step for that long -> stacks, one line naming the stuck
                    rank and its line of code (hang_stacks.py reads the stacks), exit 124
    hang_stacks.py  the stacks a hung run's ranks wrote: the stuck rank, its frame, in one line
    non_finite.py   a bad step's stop: NonFiniteLoss (exit 3); how one is found and acted on: accel_ddp/bad_steps/
    peers.py        the store the ranks agree on, and closing this rank's connections so its peers learn at once
    refusal.py      bad options, refused before torch is imported: one line within a second, exit 2 (torchrun too)
    preemption.py   SIGTERM/SIGUSR1 (or a dead launcher): every rank saves and stops (exit 75, or 130/129)
    stdio.py        stdout/stderr without a reader: writes go to /dev/null instead of failing the run
    transport.py    what gloo and NCCL say of a peer that went away or stopped answering: one table

May import: util. Everything above raises into it, so it imports nothing above util.
"""
