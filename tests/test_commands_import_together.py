"""Every command module imports beside every other (a test process imports many): each defines
its absl flags only when it runs, so no flag name is defined twice."""

import importlib


def test_the_command_modules_import_together():
    for name in ("titanax.launch", "titanax.run", "titanax.export", "titanax.generate",
                 "titanax.evaluate",
                 "titanax.data.train_tokenizer", "titanax.data.pretokenize"):
        importlib.import_module(name)
