"""A Horovod PyTorch training script; only the import line differs (``import horovod.torch as hvd``).

Run it with any launcher, e.g. ``ringpipe launch -n 2 examples/horovod_mnist_style.py`` (torchrun
agent, gloo), ``ringpipe launch -n 2 --backend mpi examples/horovod_mnist_style.py`` (mpirun) or
plain ``python examples/horovod_mnist_style.py`` (one process). It trains a small CNN on the 8x8
handwritten digits shipped with ringpipe, so it runs offline in seconds.

On a GPU host ``hvd.init()`` picks NCCL: each process is pinned to the GPU of its local rank
and the model, the batches and the metric tensors live there (start at most one process per
GPU). ``--no-cuda`` keeps everything on the CPU.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
import torch.utils.data.distributed

import ringpipe as hvd  # was: import horovod.torch as hvd
from ringpipe.train.datasets import digits_arrays  # the 8x8 digits, shipped with ringpipe

parser = argparse.ArgumentParser(description="Horovod-style digits example")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--lr", type=float, default=0.03, help="learning rate for one rank")
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--warmup-epochs", type=float, default=1)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--checkpoint", default="", help="write a checkpoint here on rank 0 after each epoch")
parser.add_argument("--no-cuda", action="store_true", default=False, help="train on the CPU even with GPUs")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.flatten(1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def adjust_learning_rate(optimizer, epoch, batch_idx, batches_per_epoch):
    # Gradual warmup (Goyal et al.): from lr to lr * size over the first warmup epochs.
    if epoch < args.warmup_epochs:
        epoch_f = epoch + float(batch_idx + 1) / batches_per_epoch
        lr_adj = 1.0 / hvd.size() * (epoch_f * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 1.0
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size() * lr_adj


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        adjust_learning_rate(optimizer, epoch, batch_idx, len(train_loader))
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    return metric_average(loss.item(), "train_loss")


def test():
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    test_loss /= len(test_sampler)
    accuracy = correct / len(test_sampler)
    return metric_average(test_loss, "avg_loss"), metric_average(accuracy, "avg_accuracy")


if __name__ == "__main__":
    args = parser.parse_args()

    # 1. Initialise (NCCL on a GPU host; on the CPU, gloo unless RINGPIPE_BACKEND says otherwise).
    if args.no_cuda:
        os.environ.setdefault("RINGPIPE_BACKEND", "gloo")
    hvd.init()
    torch.manual_seed(args.seed)
    # 2. Pin a GPU to each process (when there are GPUs). ringpipe's MPI communicator carries
    # CPU tensors (unless MPI is CUDA-aware), so under MPI the example stays on the CPU.
    args.cuda = not args.no_cuda and torch.cuda.is_available() and not hvd.mpi_enabled()
    device = torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    torch.set_num_threads(1)

    pixels, targets = digits_arrays()  # float32 pixel counts 0..16, int64 labels
    images = torch.from_numpy(pixels / 16.0).unsqueeze(1)
    labels = torch.from_numpy(targets)
    train_dataset = torch.utils.data.TensorDataset(images[:1500], labels[:1500])
    test_dataset = torch.utils.data.TensorDataset(images[1500:], labels[1500:])

    # 7. Shard the data: each rank reads its own part of every epoch.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.batch_size, sampler=test_sampler)

    model = Net().to(device)
    # 3. Scale the learning rate by the number of workers.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # 5. Start every rank from rank 0's model and optimizer.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # 4. Average gradients across ranks.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Average)

    for epoch in range(args.epochs):
        train_loss = train(epoch)
        test_loss, test_accuracy = test()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"test accuracy {100 * test_accuracy:.1f}%  (ranks: {hvd.size()})", flush=True)
            # 6. Checkpoint on rank 0 only.
            if args.checkpoint:
                os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           args.checkpoint)
    hvd.shutdown()
