"""Legacy 0.x client: Hessian spectrum edges of a small CNN (with BatchNorm) by Lanczos.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hessian_eigenthings import compute_hessian_eigenthings


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        x = F.max_pool2d(torch.tanh(self.bn1(self.conv1(x))), 2)
        return self.fc(x.view(x.size(0), -1))


torch.manual_seed(0)
images = torch.randn(64, 1, 6, 6)
labels = torch.randint(0, 3, (64,))
dataloader = DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=False)

model = Net()
criterion = nn.CrossEntropyLoss()

eigenvals, eigenvecs = compute_hessian_eigenthings(
    model, dataloader, criterion, num_eigenthings=4, mode="lanczos", use_gpu=False, max_steps=50
)
assert np.all(np.diff(eigenvals) >= 0), "ARPACK order: ascending"
print("eigenvals:", eigenvals.tolist())
print("top eigenvalue:", eigenvals[-1])
