"""Building blocks shared by the kernel families, one folder per arch family (`sm90/`: Hopper). Imports
nothing; a kernel module imports the blocks it uses as `dsagen.kernels.common.<arch family>.<module>`, and their
sources are hashed into its cache key like any other device helper."""
