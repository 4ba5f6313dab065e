"""Forming the world of processes: launch guards, preflight checks, the Accelerator and its DDP/FSDP options.

    preflight.py  one process per GPU, GPUs this torch can use, the FSDP plugin
    world.py      build_accelerator (the group formed, the batch layout derived), prepare without a 1-rank DDP

May import: util, config, lifecycle (the loop passes in the trackers the Accelerator is built with).
"""
