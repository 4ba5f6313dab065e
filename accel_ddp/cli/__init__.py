"""The ``accel-ddp`` commands, the command line, and the doctor.

    commands.py       the `accel-ddp` entry point: launch, train, doctor, summary, plot, evaluate, predict
    launch.py         `accel-ddp launch`: accelerate launch, ending with the failing rank's line and exit code
    args.py           the command line (YAML, then flags) into a TrainConfig
    train.py          main(): train, then the exit code (failure report, preemption)
    inference.py      `accel-ddp evaluate` and `predict`: a trained run's metrics again, its predictions per sample
    doctor.py         `accel-ddp doctor`: what this machine and launch config will do, before a run
    doctor_checks.py  the doctor's checks of a launch config (traps, machines, GPUs, precision, rendezvous)
    doctor_report.py  the doctor's findings and the report it prints
    machine.py        what the doctor reads of the machine (GPUs, CPUs, packages)
    launch_config.py  what the doctor reads of an accelerate launch config

May import: anything in the package (it is the top: nothing imports cli but ``__main__``).
"""
