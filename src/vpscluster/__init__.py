"""vpscluster: turn a handful of rented machines into a cluster that trains language models."""

import warnings

__version__ = "0.1.0"

# cryptography >= 51 warns about DSA when asyncssh (which still supports DSA keys) is imported: a
# library's notice, not the user's, and on stderr it would break vpscluster's one-line errors.
warnings.filterwarnings("ignore", message="DSA is deprecated")
