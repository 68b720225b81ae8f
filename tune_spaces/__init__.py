"""Search spaces for ``lightray tune --space NAME``, installed as package data (``lightray.spaces``)."""
