"""A user's model for ``hvd-acp-ab --model ...:build`` in the tests: a small
convolutional net on 16x16 images, with and without a loss function of its own."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16 * 16 * 16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(images)).flatten(1))


def build(batch_size: int):
    """(model, batch, loss_fn), the batch a tuple."""
    images = torch.randn(batch_size, 3, 16, 16)
    labels = torch.randint(0, 10, (batch_size,))

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(*batch), labels)
    return Net(), (images,), loss_fn


def build_without_loss(batch_size: int):
    """(model, batch): the A/B tool falls back to a stand-in loss."""
    return Net(), torch.randn(batch_size, 3, 16, 16)


def build_wrong(batch_size: int):
    return "not a model"
