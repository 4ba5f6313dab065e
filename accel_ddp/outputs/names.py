"""The names of everything a run writes, defined once. No torch import (the CLI reads runs too).

    OUTPUT_DIR/config.yaml          resolved training config, plus world size and accelerate state
    OUTPUT_DIR/metrics.jsonl        one JSON object per logged step, epoch and evaluation
    OUTPUT_DIR/summary.json         final figures
    OUTPUT_DIR/run.log              what the main process printed, each start's: its start-up block, warnings, lines
    OUTPUT_DIR/model.safetensors    final weights of the unwrapped model
    OUTPUT_DIR/hf_model/            Transformers models: the final model (save_pretrained) and its tokenizer
    OUTPUT_DIR/curves.png           losses, the task's eval metric, LR and throughput against step
    OUTPUT_DIR/metrics.csv          with the csv tracker
    OUTPUT_DIR/tensorboard/         with the tensorboard tracker
    OUTPUT_DIR/wandb/               with the wandb tracker (unless WANDB_DIR says elsewhere)
    OUTPUT_DIR/mlflow.db, mlruns/   with the mlflow tracker and no MLFLOW_TRACKING_URI: its local store
    OUTPUT_DIR/trackers.json        the W&B and MLflow run ids a resumed run continues
    OUTPUT_DIR/anomalies.json       --on_anomaly skip|rollback: the steps left out, which a resumed run leaves out too
    OUTPUT_DIR/README.md            the model card: model, data, batch layout, final metrics, launch command
    OUTPUT_DIR/profile/rank<R>.json with --profile: one Chrome trace per rank
    OUTPUT_DIR/checkpoints/step_00000100/   full training state; checkpoint.json is its completion marker
    OUTPUT_DIR/.lock                the run's exclusive lock (run_dir.py): one run per folder at a time
    OUTPUT_DIR/.store-claim         --checkpoint_dir: this folder's random id, also in the store's lock object
"""

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
RUN_LOG_NAME = "run.log"  # what the main process printed (tracking/console_log.py); a resumed run appends
WEIGHTS_NAME = "model.safetensors"
ADAPTER_SUBDIR = "adapter"  # --peft lora: PeftModel.from_pretrained(base, OUTPUT_DIR/adapter); the tokenizer too
PRETRAINED_SUBDIR = "hf_model"  # AutoModelFor...from_pretrained(OUTPUT_DIR/hf_model); the tokenizer too
CURVES_NAME = "curves.png"
CSV_NAME = "metrics.csv"
MLFLOW_STORE = "mlflow.db"  # MLflow's store when MLFLOW_TRACKING_URI is not set (its artifacts: mlruns/ beside it)
TENSORBOARD_SUBDIR = "tensorboard"  # Accelerate's TensorBoardTracker writes to logging_dir/<its run name>
TRACKERS_NAME = "trackers.json"
ANOMALIES_NAME = "anomalies.json"  # run-level (bad_steps/): never rewound with metrics.jsonl
MODEL_CARD_NAME = "README.md"
PROFILE_SUBDIR = "profile"
CHECKPOINTS_DIR = "checkpoints"
MARKER_NAME = "checkpoint.json"  # inside each checkpoint folder, written last
STORE_CLAIM_NAME = ".store-claim"  # a nonce: the store's lock names this very folder, not one at the same path
LOCK_NAME = ".lock"  # locked (lockf) by the main process for the whole run; an empty file left in place
