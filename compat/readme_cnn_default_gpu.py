"""Legacy 0.x client in the pattern of 0.x's README: a CNN built on the CPU, a DataLoader,
and compute_hessian_eigenthings with use_gpu left at its default (True).

0.x moved the model to CUDA (model.cuda()) and every batch as it read it; with CUDA the
facade does the same, without CUDA it warns once and runs on the CPU.
Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hessian_eigenthings import compute_hessian_eigenthings


class ConvNet(nn.Module):
    def __init__(self):
        super(ConvNet, self).__init__()  # noqa: UP008 -- written in the style of its time
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(x.size(0), -1)
        return self.fc2(torch.tanh(self.fc1(x)))


torch.manual_seed(0)
images = torch.randn(256, 1, 8, 8)
labels = torch.randint(0, 4, (256,))
loader = DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=False)

net = ConvNet()
loss = nn.CrossEntropyLoss()

eigenvals, eigenvecs = compute_hessian_eigenthings(
    net, loader, loss, num_eigenthings=3, power_iter_steps=10
)
print("Eigenvecs:")
print(eigenvecs.shape)
print("Eigenvals:")
print(eigenvals)
