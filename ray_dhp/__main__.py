"""``python -m ray_dhp`` / ``python -m ray_dhp.cli``: the ``ray-dhp`` command line."""

from ray_dhp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
