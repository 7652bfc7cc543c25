"""``python -m ray_disagg ...`` is the ``ray-disagg`` command (:mod:`ray_disagg.recipes.cli`)."""

from ray_disagg.recipes.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
