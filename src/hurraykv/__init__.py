"""hurraykv"""
