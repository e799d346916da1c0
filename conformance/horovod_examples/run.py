#!/usr/bin/env python3
"""Horovod's own example programs against ringpipe: 2 ranks over gloo on the CPU, tiny settings.

    .venv/bin/python conformance/horovod_examples/run.py HOROVOD_CHECKOUT [NAME...] [--list] [--backend mpi]

Copies each chosen program from HOROVOD_CHECKOUT/examples into ./horovod-examples-out/NAME/ (with
--backend mpi: ./horovod-examples-out-mpi/NAME/), changes only the Horovod import lines (IMPORTS below; `import horovod` for horovod.run becomes `import ringpipe as horovod`),
and runs each chosen program (all of PROGRAMS by default) under `ringpipe-horovodrun -np 2` (or
plain python where the program starts itself through horovod.run), with arguments the program
already has for epochs, batch sizes and iterations. Where a program has none, a minimal sed of a
constant is listed with the program in PROGRAMS, each with its reason (a listed sed that no longer
matches stops the harness). Each run's log is NAME/run.log; summary.txt collects the verdicts.

Test doubles (data and models only; ringpipe itself is never replaced): shim/torchvision (random
MNIST / ImageFolder data of the real shapes, transforms, a small CNN as models.resnet50) and
shim/fake_data.py (mnist.npz files of random arrays; Keras's load_data checks the real file's
hash, so the examples' `...mnist.load_data(` call is pointed at fake_data by the one DATA_SED).
Runs named in EXPECTED_FAIL (a cause outside ringpipe) print XFAIL; the exit status is 0 when every other
run passes. FAKE_DATA_N sets the fake datasets' size (default 256; the ImageNet ones use 32). Keras's
ImageNet example reads JPEG folders: fake_data writes 1000 class folders, two of them with 4 random
JPEGs each. A command with " ;; " runs the program again in the same folder (resume from checkpoint).

Variant suffixes: "_legacy" runs on tf-keras (TF_USE_LEGACY_KERAS=1); "_keras2" also reads the
standalone `import keras` as `import tf_keras as keras`; "_tf1dropped" deletes the TF1 GPU-pinning
lines (tf.ConfigProto / tf.Session / K.set_session), which TensorFlow 2 no longer has and which do
nothing on a CPU; "_keras3" writes the program's one Keras 2 call in Keras 3's spelling. Needs tensorboard for the PyTorch ImageNet programs
(torch.utils.tensorboard), filelock, tqdm, packaging.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)

IMPORTS = [  # (pattern, replacement): Horovod's import lines -> ringpipe's; nothing else changes
    (r"^(\s*)import horovod\.torch as hvd\b", r"\1import ringpipe as hvd"),
    (r"^(\s*)import horovod\.tensorflow\.keras as hvd\b", r"\1import ringpipe.tensorflow.keras as hvd"),
    (r"^(\s*)import horovod\.tensorflow as hvd\b", r"\1import ringpipe.tensorflow as hvd"),
    (r"^(\s*)import horovod\.keras as hvd\b", r"\1import ringpipe.keras as hvd"),
    (r"^(\s*)import horovod\s*$", r"\1import ringpipe as horovod"),
]
# the one data sed: Keras's MNIST download -> the fake mnist.npz files (test double)
DATA_SED = (r"\b(?:tf\.keras\.datasets\.|keras\.datasets\.)?mnist\.load_data\(",
            "__import__('fake_data').mnist_load_data(")
KERAS2_SED = [(r"^import keras\b", "import tf_keras as keras"), (r"^from keras(\.| )", r"from tf_keras\1")]
TF1_SED = [(r"^(config = tf\.ConfigProto\(\)|config\.gpu_options\..*|K\.set_session\(tf\.Session\(.*)$",
            r"pass  # TF1 GPU pinning dropped: \1")]
LEGACY = {"TF_USE_LEGACY_KERAS": "1"}
# Keras 3 variants: the one Keras 2 call each program makes, in Keras 3's spelling
K3_COMPILE = (r",\s*experimental_run_tf_function=False", "", "Keras 3: compile() without experimental_run_tf_function")
K3_VARIABLES = (r"opt\.variables\(\)", "opt.variables", "Keras 3: optimizer.variables is a list")

# the shortened runs that several variants of one program share
MNIST_STEPS = [(r"10000 // hvd\.size\(\)", "8 // hvd.size()", "10000 steps -> 8")]
KERAS_MNIST_SHORT = [(r"500 // hvd\.size\(\)", "8 // hvd.size()", "500 steps per epoch -> 8"),
                     (r"epochs=24\b", "epochs=2", "24 epochs -> 2")]
ELASTIC_KERAS_MNIST_SHORT = [(r"500 // hvd\.size\(\)", "8 // hvd.size()", "500 steps per epoch -> 8"),
                             (r"epochs=24-state", "epochs=2-state", "24 epochs -> 2")]
TF2_SYNTHETIC = "--model MobileNetV2 --batch-size 2 --num-warmup-batches 1 --num-batches-per-iter 1 --num-iters 2"
KERAS_SYNTHETIC = "--model MobileNetV2 --batch-size 2 --num-batches-per-iter 1 --num-iters 2"

# name: (program, command after the program's path, env, [(pattern, replacement, reason)])
PROGRAMS = {
    "pytorch_mnist": ("pytorch/pytorch_mnist.py", "--epochs 1 --batch-size 32 --test-batch-size 64", {}, []),
    "pytorch_mnist_fp16_adasum": ("pytorch/pytorch_mnist.py",
                                  "--epochs 1 --batch-size 32 --test-batch-size 64 --fp16-allreduce --use-adasum", {}, []),
    "pytorch_mnist_horovod_run": ("pytorch/pytorch_mnist.py",
                                  "PY --epochs 1 --batch-size 32 --test-batch-size 64 --num-proc 2 --communication gloo",
                                  {}, []),
    "pytorch_imagenet_resnet50": ("pytorch/pytorch_imagenet_resnet50.py",
                                  "--epochs 2 --batch-size 4 --val-batch-size 4 --batches-per-allreduce 2 --warmup-epochs 1 "
                                  "--train-dir imagenet/train --val-dir imagenet/validation", {"FAKE_DATA_N": "32"}, []),
    "pytorch_imagenet_resnet50_fp16_adasum": ("pytorch/pytorch_imagenet_resnet50.py",
                                              "--epochs 1 --batch-size 4 --val-batch-size 4 --batches-per-allreduce 2 "
                                              "--warmup-epochs 1 --fp16-allreduce --use-adasum "
                                              "--train-dir imagenet/train --val-dir imagenet/validation",
                                              {"FAKE_DATA_N": "32"}, []),
    "pytorch_synthetic_benchmark": ("pytorch/pytorch_synthetic_benchmark.py",
                                    "--model resnet50 --batch-size 2 --num-warmup-batches 1 --num-batches-per-iter 1 "
                                    "--num-iters 2", {}, []),
    "elastic_pytorch_mnist": ("elastic/pytorch/pytorch_mnist_elastic.py",
                              "--epochs 2 --batch-size 32 --test-batch-size 64", {}, []),
    "elastic_pytorch_imagenet_resnet50": ("elastic/pytorch/pytorch_imagenet_resnet50_elastic.py",
                                          "--epochs 2 --batch-size 4 --val-batch-size 4 --warmup-epochs 1 "
                                          "--batches-per-commit 2 --batches-per-host-check 2 "
                                          "--train-dir imagenet/train --val-dir imagenet/validation",
                                          {"FAKE_DATA_N": "32"}, []),
    "elastic_pytorch_imagenet_resnet50_fp16_batches2": ("elastic/pytorch/pytorch_imagenet_resnet50_elastic.py",
                                                        "--epochs 1 --batch-size 4 --val-batch-size 4 --warmup-epochs 1 "
                                                        "--batches-per-allreduce 2 --fp16-allreduce "
                                                        "--batches-per-commit 1 --batches-per-host-check 1 "
                                                        "--train-dir imagenet/train --val-dir imagenet/validation",
                                                        {"FAKE_DATA_N": "32"}, []),
    "elastic_pytorch_synthetic_benchmark": ("elastic/pytorch/pytorch_synthetic_benchmark_elastic.py",
                                            "--model resnet50 --batch-size 2 --num-warmup-batches 1 "
                                            "--num-batches-per-iter 1 --num-iters 2", {}, []),
    "tensorflow2_mnist": ("tensorflow2/tensorflow2_mnist.py", "", {}, MNIST_STEPS),
    "tensorflow2_mnist_legacy": ("tensorflow2/tensorflow2_mnist.py", "", LEGACY, MNIST_STEPS),
    "tensorflow2_mnist_keras3": ("tensorflow2/tensorflow2_mnist.py", "", {}, [*MNIST_STEPS, K3_VARIABLES]),
    "tensorflow2_keras_mnist": ("tensorflow2/tensorflow2_keras_mnist.py", "", {}, KERAS_MNIST_SHORT),
    "tensorflow2_keras_mnist_keras3": ("tensorflow2/tensorflow2_keras_mnist.py", "", {},
                                       [*KERAS_MNIST_SHORT, K3_COMPILE]),
    "tensorflow2_keras_mnist_legacy": ("tensorflow2/tensorflow2_keras_mnist.py", "", LEGACY, KERAS_MNIST_SHORT),
    "tensorflow2_synthetic_benchmark": ("tensorflow2/tensorflow2_synthetic_benchmark.py", TF2_SYNTHETIC, {}, []),
    "tensorflow2_keras_synthetic_benchmark": ("tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
                                              KERAS_SYNTHETIC, {}, []),
    "tensorflow2_keras_synthetic_benchmark_keras3": ("tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
                                                     KERAS_SYNTHETIC, {}, [K3_COMPILE]),
    "tensorflow2_keras_synthetic_benchmark_legacy": ("tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
                                                     KERAS_SYNTHETIC, LEGACY, []),
    "elastic_tensorflow2_keras_mnist": ("elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py", "", {},
                                        ELASTIC_KERAS_MNIST_SHORT),
    "elastic_tensorflow2_keras_mnist_keras3": ("elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py", "", {},
                                               [*ELASTIC_KERAS_MNIST_SHORT, K3_COMPILE]),
    "elastic_tensorflow2_keras_mnist_legacy": ("elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py", "", LEGACY,
                                               ELASTIC_KERAS_MNIST_SHORT),
    "elastic_tensorflow2_mnist": ("elastic/tensorflow2/tensorflow2_mnist_elastic.py", "", {},
                                  [(r"100 // hvd\.size\(\)", "8 // hvd.size()", "100 steps -> 8")]),
    "elastic_tensorflow2_mnist_horovod_run": ("elastic/tensorflow2/tensorflow2_mnist_elastic.py",
                                              "PY 2 2 2 localhost:2", {},
                                              [(r"100 // hvd\.size\(\)", "8 // hvd.size()", "100 steps -> 8")]),
    "tensorflow2_synthetic_benchmark_keras3": ("tensorflow2/tensorflow2_synthetic_benchmark.py",
                                               TF2_SYNTHETIC, {}, [K3_VARIABLES]),
    "tensorflow2_synthetic_benchmark_legacy": ("tensorflow2/tensorflow2_synthetic_benchmark.py",
                                               TF2_SYNTHETIC, LEGACY, []),
    "tensorflow2_synthetic_benchmark_legacy_fp16": ("tensorflow2/tensorflow2_synthetic_benchmark.py",
                                                    "--model MobileNetV2 --batch-size 2 --num-warmup-batches 1 "
                                                    "--num-batches-per-iter 1 --num-iters 2 --fp16-allreduce", LEGACY, []),
    "elastic_tensorflow2_synthetic_benchmark": ("elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py",
                                                "--model MobileNetV2 --batch-size 2 --num-warmup-batches 1 "
                                                "--num-batches-per-iter 1 --num-iters 2 --num-batches-per-commit 1",
                                                {}, []),
    "elastic_tensorflow_keras_mnist": ("elastic/tensorflow/tensorflow_keras_mnist_elastic.py",
                                       "--batches-per-epoch 8 --epochs 2 --batch-size 32", {}, []),
    "elastic_tensorflow_keras_mnist_keras2_tf1dropped": ("elastic/tensorflow/tensorflow_keras_mnist_elastic.py",
                                                         "--batches-per-epoch 8 --epochs 2 --batch-size 32", LEGACY,
                                                         [(*TF1_SED[0], "TF1 session lines dropped")]),
    "keras_mnist": ("keras/keras_mnist.py", "", {},
                    [(r"^epochs = .*$", "epochs = 1", "ceil(12 / size) epochs -> 1")]),
    "keras_mnist_keras2": ("keras/keras_mnist.py", "", LEGACY,
                           [(r"^epochs = .*$", "epochs = 1", "ceil(12 / size) epochs -> 1")]
                           + [(p, r, "keras -> tf_keras") for p, r in KERAS2_SED]),
    "keras_mnist_keras2_tf1dropped": ("keras/keras_mnist.py", "", LEGACY,
                                      [(r"^epochs = .*$", "epochs = 1", "ceil(12 / size) epochs -> 1"),
                                       (*TF1_SED[0], "TF1 session lines dropped")]
                                      + [(p, r, "keras -> tf_keras") for p, r in KERAS2_SED]),
    "keras_mnist_tf1dropped": ("keras/keras_mnist.py", "", {},
                               [(r"^epochs = .*$", "epochs = 1", "ceil(12 / size) epochs -> 1"),
                                (*TF1_SED[0], "TF1 session lines dropped")]),
    "elastic_tensorflow_keras_mnist_tf1dropped": ("elastic/tensorflow/tensorflow_keras_mnist_elastic.py",
                                                  "--batches-per-epoch 8 --epochs 2 --batch-size 32", {},
                                                  [(*TF1_SED[0], "TF1 session lines dropped")]),
    "keras_imagenet_resnet50": ("keras/keras_imagenet_resnet50.py",
                                "--epochs 1 --batch-size 2 --val-batch-size 2 --warmup-epochs 1 "
                                "--train-dir IMAGES/train --val-dir IMAGES/validation", {}, []),
    # run twice in one folder: the second run resumes from checkpoint-1.h5 through hvd.load_model
    "keras_imagenet_resnet50_keras2_tf1dropped": ("keras/keras_imagenet_resnet50.py",
                                                  "--epochs 1 --batch-size 2 --val-batch-size 2 --warmup-epochs 1 "
                                                  "--train-dir IMAGES/train --val-dir IMAGES/validation ;; "
                                                  "--epochs 2 --batch-size 2 --val-batch-size 2 --warmup-epochs 1 "
                                                  "--train-dir IMAGES/train --val-dir IMAGES/validation", LEGACY,
                                                  [(*TF1_SED[0], "TF1 session lines dropped")]
                                                  + [(p, r, "keras -> tf_keras") for p, r in KERAS2_SED]),
    "keras_mnist_advanced": ("keras/keras_mnist_advanced.py", "--epochs 2 --batch-size 32", {}, []),
    "keras_mnist_advanced_keras2_tf1dropped": ("keras/keras_mnist_advanced.py", "--epochs 2 --batch-size 32", LEGACY,
                                               [(*TF1_SED[0], "TF1 session lines dropped")]
                                               + [(p, r, "keras -> tf_keras") for p, r in KERAS2_SED]),
}


# Runs that fail for a reason outside ringpipe (the program's own use of an API that Keras 3 /
# TensorFlow 2 removed, or an elastic launch ringpipe.run refuses by design): reported as XFAIL.
KERAS3_VARIABLES = "Keras 3: optimizer.variables is a list, the program calls opt.variables()"
KERAS3_COMPILE = "Keras 3: Model.compile() has no experimental_run_tf_function"
TF1 = "TensorFlow 2 has no tf.ConfigProto / tf.Session (the program's TF1 GPU pinning)"
EXPECTED_FAIL = {
    "tensorflow2_mnist": KERAS3_VARIABLES,
    "tensorflow2_synthetic_benchmark": KERAS3_VARIABLES,
    "tensorflow2_keras_mnist": KERAS3_COMPILE,
    "tensorflow2_keras_synthetic_benchmark": KERAS3_COMPILE,
    "elastic_tensorflow2_keras_mnist": KERAS3_COMPILE,
    "elastic_tensorflow2_mnist_horovod_run": "horovod.run with min/max_num_proc is an elastic launch; ringpipe.run "
                                             "refuses elastic launches (fixed num_proc only)",
    "keras_mnist": TF1,
    "keras_imagenet_resnet50": TF1,
    "keras_mnist_keras2": TF1,
    "keras_mnist_advanced": "Keras 3 has no keras.preprocessing.image.ImageDataGenerator (and the program's TF1 "
                            "session lines, Model.fit_generator, Adadelta(lr=))",
    "elastic_tensorflow_keras_mnist": TF1,
}

def rewrite(path, seds, log):
    with open(path) as f:
        text = f.read()
    for pattern, repl, *reason in [*IMPORTS, DATA_SED, *seds]:  # reason: a sed that must match
        text, n = re.subn(pattern, repl, text, flags=re.M)
        if reason and n == 0:
            raise SystemExit(f"{path}: the sed {pattern!r} ({reason[0]}) matched nothing: the example changed")
        if n:
            log.write(f"sed {pattern!r} -> {repl!r} x{n}{' (' + reason[0] + ')' if reason else ''}\n")
    with open(path, "w") as f:
        f.write(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout")
    p.add_argument("names", nargs="*")
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout", type=float, default=900, help="seconds per program (default 900)")
    p.add_argument("--backend", choices=["gloo", "mpi"], default="gloo",
                   help="horovodrun's --gloo / --mpi for the launched programs (default gloo)")
    a = p.parse_intermixed_args()
    if a.list:
        print("\n".join(PROGRAMS))
        return 0
    unknown = [n for n in a.names if n not in PROGRAMS]
    if unknown:
        raise SystemExit(f"unknown program name(s) {unknown}; --list shows the names")
    out = os.path.abspath("horovod-examples-out" + ("-mpi" if a.backend == "mpi" else ""))
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "data")
    os.makedirs(data, exist_ok=True)
    sys.path.insert(0, os.path.join(HERE, "shim"))
    import fake_data
    for i, name in enumerate(["mnist.npz", "mnist-0.npz", "mnist-1.npz"]):
        fake_data.write_npz(os.path.join(data, name), seed=i)
    for i, split in enumerate(["train", "validation"]):
        if not os.path.isdir(os.path.join(data, "imagenet", split)):
            fake_data.write_image_folder(os.path.join(data, "imagenet", split), seed=i)
    results = []
    for name in a.names or list(PROGRAMS):
        prog, args, env_extra, seds = PROGRAMS[name]
        work = os.path.join(out, name)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        with open(os.path.join(work, "run.log"), "w") as log:
            src = os.path.join(a.checkout, "examples", prog)
            dst = os.path.join(work, os.path.basename(prog))
            shutil.copy(src, dst)
            rewrite(dst, seds, log)
            env = dict(os.environ, **env_extra, FAKE_DATA_DIR=data, CUDA_VISIBLE_DEVICES="", HOME=work,
                       PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "shim"), os.environ.get("PYTHONPATH")])))
            python = sys.executable
            if args.startswith("PY "):  # the program starts its own workers through horovod.run
                cmd = f"{python} {os.path.basename(prog)} {args[3:]}"
            else:
                cmd = " && ".join(f"{BIN}/ringpipe-horovodrun -np 2 --{a.backend} python {os.path.basename(prog)} {part}"
                                  for part in args.replace("IMAGES/", os.path.join(data, "imagenet") + "/").split(" ;; "))
            log.write(f"$ {' '.join(f'{k}={v}' for k, v in env_extra.items())} {cmd}\n")
            log.flush()
            t0 = time.time()
            proc = subprocess.Popen(cmd, shell=True, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: their own session
                proc.wait()
                rc = "timeout"
            dt = time.time() - t0
        why = EXPECTED_FAIL.get(name)
        verdict = ("XPASS" if why else "PASS") if rc == 0 else (f"XFAIL ({rc})" if why else f"FAIL ({rc})")
        results.append((name, verdict, dt))
        print(f"{name:50s} {verdict:12s} {dt:5.0f} s  {work}/run.log" + (f"\n{'':50s} expected: {why}" if why else ""),
              flush=True)
    with open(os.path.join(out, "summary.txt"), "a") as f:
        for name, verdict, dt in results:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {name} {verdict} {dt:.0f}s\n")
    return 0 if all(v == "PASS" or v.startswith("XFAIL") for _, v, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
