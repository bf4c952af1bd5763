"""A Trainer's steps marked for the probe, the same way for transformers and PaddleNLP: every
Trainer built after the probe started gets a callback that hands the probe the Trainer's arguments
at the start of training and marks each optimizer step's beginning and end. The adapters' probe
hooks pass their framework's callback base class and their reading of the arguments::

    attach_callback(transformers.trainer.Trainer, transformers.TrainerCallback, framework, probe,
                    trainer_settings)
"""

from __future__ import annotations

from typing import Any, Callable


def attach_callback(trainer_class: type, callback_base: type, framework: Any, probe: Any,
                    settings: Callable[[Any], dict]) -> None:
    """Wrap ``trainer_class.__init__`` so each new Trainer adds the probe's callback (through
    ``probe.call``: a failure is recorded, never raised into the script). ``framework`` None: the
    framework hooks did not install, and Trainers are left alone."""

    class XfwProbeCallback(callback_base):
        """Marks the Trainer's steps for xfw's probe."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            probe.trainer_began(framework, settings(args), model)

        def on_step_begin(self, args, state, control, **kwargs):
            probe.step_began()

        def on_step_end(self, args, state, control, **kwargs):
            probe.boundary(framework, "trainer")

    original = trainer_class.__init__

    def __init__(trainer, *args, **kwargs):
        original(trainer, *args, **kwargs)
        if framework is not None:
            probe.call(trainer.add_callback, XfwProbeCallback())

    __init__.__wrapped__ = original
    trainer_class.__init__ = __init__
