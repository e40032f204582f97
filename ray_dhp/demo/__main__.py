"""``python -m ray_dhp.demo``: the main job, training the bundled tiny VLM (`ray_dhp.demo.run`)."""

from ray_dhp.demo.run import main

if __name__ == "__main__":
    main()
