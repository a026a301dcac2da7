"""`python -m expgpu.warm_server PATH`, as docs/quick-start.md has it: the warm server lives in expgpu.launch."""

from expgpu.launch.warm_server import main

if __name__ == "__main__":
    main()
