"""A stand-in for the three pieces of torchvision the VAE example uses (datasets.MNIST,
transforms.ToTensor, utils.save_image), for machines where torchvision cannot be installed (its
PyPI wheel is built for CUDA torch and does not import beside torch's CPU build).

It is on the path only when examples/ports/offline is (the tests add it when `import torchvision`
fails); with the real torchvision installed, the example reads the same files through it.
MNIST here reads the raw files examples/ports/make_data.py writes and never downloads.
"""

from . import datasets, transforms, utils  # noqa: F401
