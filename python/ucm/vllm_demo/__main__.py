"""``python -m ucm.vllm_demo``: runs :func:`ucm.vllm_demo.demo.main`."""

import sys

from ucm.vllm_demo.demo import main

sys.exit(main())
