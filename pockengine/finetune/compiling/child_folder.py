"""The files of a compile child's folder: what the parent writes (the job), what the child
writes (the step artifact, the task, the auto choice, the model's skeleton) and its error.
Torch-free: the parent that starts the child holds no torch."""

from __future__ import annotations

__all__ = [
    "CHOICE",
    "ERROR",
    "JOB",
    "MODEL_DIR",
    "NEEDS_MODEL",
    "STEP_DIR",
    "TASK_DATA",
    "TASK_JSON",
]

JOB, ERROR, TASK_JSON, TASK_DATA = "job.json", "error.json", "task.json", "task.safetensors"
CHOICE = "choice.json"  # --scheme auto: the choice (``AutoChoice.to_dict``)
STEP_DIR, MODEL_DIR, NEEDS_MODEL = "step", "model", "needs-model.txt"
