"""``python -m ray_disagg ...`` is the ``ray-disagg`` command (see :mod:`ray_disagg.cli`)."""

from ray_disagg.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
