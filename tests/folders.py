"""Where the tests live. A test module's folder says what it tests (core, api, triton, ck, integrations, scripts,
project) or where it runs: gpu holds every test that needs a CUDA GPU (marker `gpu`), rocm every test that needs
an AMD GPU and the built CK library (marker `rocm`); the other folders hold no test of either marker
(conftest.py refuses a collection that breaks this). A test that runs on CPU tensors belongs to its topic's folder
even where its subject is GPU code (a pretended sm_90 device, Gluon compiled for sm_90a, fake drivers): it behaves
the same on a GPU host, so the GPU pass (scripts/device.sh gpu-tests) leaves it out; what changes with the Triton
release is run under each release on the CPU (scripts/triton_matrix.sh). The support modules (cases, oracle, ...)
sit here in tests/.

Every folder of test modules is on sys.path (conftest.py), so a test or support module imports another by its
basename from any folder; basenames are unique across the folders. A subprocess that imports them by basename
gets the same path through PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# folder (relative to tests/) -> the marker every test in it carries; a folder left out carries neither marker
MARKED_FOLDERS = {"gpu": "gpu", "rocm": "rocm"}
TEST_FOLDERS = sorted(path.parent for path in TESTS.rglob("test_*.py"))
IMPORT_PATHS = [TESTS, *dict.fromkeys(TEST_FOLDERS)]
PYTHONPATH = os.pathsep.join(str(path) for path in [ROOT, *IMPORT_PATHS])
