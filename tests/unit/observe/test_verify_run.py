"""`ringpipe doctor RUN --verify`: which finding's fix is a training change it can measure."""

from ringpipe.observe.verify_run import training_change


def test_the_first_train_command_among_the_fixes_is_the_change():
    fixes = ["check the links", "ringpipe train --set pipeline.balance=[3,2,1] (now [2, 2, 2])",
             "ringpipe train --set pipeline.microbatches=16"]
    assert training_change(fixes) == ["--set", "pipeline.balance=[3,2,1]"]
    assert training_change(["ringpipe train --mode interleaved --set pipeline.chunks=2"]) == [
        "--mode", "interleaved", "--set", "pipeline.chunks=2"]


def test_no_train_command_no_change():
    assert training_change(["start the job on the other hosts", ""]) is None
