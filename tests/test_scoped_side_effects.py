"""Compiling a Keras model leaves the user's process as it was: no environment variable set
for good (PockEngine sets TensorFlow's start-up log level only while it imports it) and
the thread counts of torch and TensorFlow unchanged. Run in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

SCRIPT = """
import json, os
import numpy as np
import torch
import keras  # TensorFlow sets a few variables of its own (TF_CPP_MIN_LOG_LEVEL among them)
os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)  # so that setting it again would show
import pockengine as pe
env_before = dict(os.environ)
torch_threads = torch.get_num_threads()
keras.utils.set_random_seed(0)
inp = keras.Input((4,))
model = keras.Model(inp, keras.layers.Dense(3, name="head")(inp))
x = np.zeros((2, 4), np.float32)
y = np.zeros((2,), np.int64)
step = pe.compile(model, loss="cross_entropy", example_batch=(x, y))
step(x, y)
import tensorflow as tf
threads = tf.config.threading
print(json.dumps({
    "added": sorted(set(os.environ) - set(env_before)),
    "changed": sorted(k for k in env_before if os.environ.get(k) != env_before[k]),
    "torch_threads": [torch_threads, torch.get_num_threads()],
    "tf_threads": [threads.get_intra_op_parallelism_threads(),
                   threads.get_inter_op_parallelism_threads()],
}))
"""


def test_compiling_a_keras_model_sets_no_environment_and_keeps_thread_counts() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["added"] == []
    assert facts["changed"] == []
    before, after = facts["torch_threads"]
    assert before == after
    assert facts["tf_threads"] == [0, 0]  # TensorFlow's defaults: nothing set
