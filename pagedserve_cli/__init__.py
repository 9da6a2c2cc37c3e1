"""pagedserve_cli package."""
