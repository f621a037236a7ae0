"""Package layout only (metadata lives in pyproject.toml).

conf/ sits at the top level of the repository (design card) and ships inside the package as the data
package `epo_cli.conf`, so an installed wheel finds the config tree without the repository.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["epo_cli", "epo_cli.*"]), "epo_cli.conf"],
    package_dir={"epo_cli.conf": "conf"},
    package_data={"epo_cli.conf": ["*.yaml", "**/*.yaml"]},
)
